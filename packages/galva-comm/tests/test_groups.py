"""Process-group creation on real gloo ranks: one communicator per distinct rank tuple, never one per layer."""

from __future__ import annotations

import pytest

from galva_comm.testing import run_distributed
from galva_schema import Strategy


def _mixed_plan() -> Strategy:
    tps = [1, 2, 4, 2] * 8  # 32 layers of mixed tp, strided and consecutive
    layers = [
        {"tp": tp, "tp_consecutive": i % 3 != 0, "dp_type": ["ddp", "zero2", "zero3"][i % 3], "checkpoint": i % 2 == 1}
        for i, tp in enumerate(tps)
    ]
    return Strategy.model_validate(
        {"world_size": 8, "pp": 2, "global_batch_size": 16, "layers": layers, "vocab": {"tp": 2}}
    )


def _create_and_use(rank: int, world_size: int) -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    from galva_comm.groups import ProcessGroupCache
    from galva_comm.layout import RankLayout

    layout = RankLayout(_mixed_plan())
    calls = 0
    real_new_group = dist.new_group

    def counting_new_group(*args: object, **kwargs: object) -> object:  # counts, then calls the real thing
        nonlocal calls
        calls += 1
        return real_new_group(*args, **kwargs)  # type: ignore[arg-type]

    dist.new_group = counting_new_group  # type: ignore[assignment]
    try:
        cache = ProcessGroupCache()
        cache.create_for_layout(layout)
        cache.create_for_layout(layout)  # idempotent: nothing new
    finally:
        dist.new_group = real_new_group
    # every layer's tp group works: an all-reduce inside it sums the ranks of that group
    total = 0.0
    for groups in layout.layers:
        if rank not in groups.ranks:
            continue
        tp = groups.of("tp", rank)
        if len(tp) > 1:
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=cache.get(tp))
            assert value.item() == sum(tp), (tp, value.item())
            total += value.item()
    return calls, len(cache), total


@pytest.mark.distributed
def test_one_communicator_per_distinct_group_on_gloo() -> None:
    from galva_comm.layout import RankLayout

    layout = RankLayout(_mixed_plan())
    distinct = layout.all_groups()
    per_layer = sum(
        len([g for g in kind if len(g) > 1])
        for groups in layout.layers
        for kind in (groups.tp, groups.sp, groups.dp, groups.shard)
    )
    assert len(distinct) < per_layer / 4  # sharing is real: far fewer groups than layer-group slots
    results = run_distributed(_create_and_use, 8, timeout=120)
    for calls, cached, _ in results:
        assert calls == len(distinct)  # exactly one new_group per distinct tuple (world group reused)
        assert cached == len(distinct)
