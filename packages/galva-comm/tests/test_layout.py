"""Rank layout algebra, checked exhaustively for world sizes 1..64 and every valid degree."""

from __future__ import annotations

import itertools
import random

import pytest

from galva_comm.layout import (
    RankLayout,
    data_parallel_groups,
    embedding_tie_groups,
    expert_groups,
    model_parallel_groups,
    pipeline_groups,
    stage_ranks,
)
from galva_comm.shards import ShardLayout, redistribution_plan
from galva_schema import GroupKind, Strategy


def local(plan) -> bool:
    """No rank needs data from another rank."""
    return all(t.src == t.dst for t in plan.transfers)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _assert_partition(groups: list[tuple[int, ...]], ranks: tuple[int, ...], size: int) -> None:
    flat = [r for g in groups for r in g]
    assert sorted(flat) == sorted(ranks), "every rank in exactly one group"
    assert all(len(g) == size for g in groups)
    assert all(list(g) == sorted(g) for g in groups)


@pytest.mark.parametrize("world_size", range(1, 65))
def test_every_degree_partitions_every_stage(world_size: int) -> None:
    for pp in _divisors(world_size):
        per_stage = world_size // pp
        pipes = pipeline_groups(world_size, pp)
        _assert_partition(pipes, tuple(range(world_size)), pp)
        for pipe in pipes:  # one rank per stage, same local rank
            assert [r // per_stage for r in pipe] == list(range(pp))
            assert len({r % per_stage for r in pipe}) == 1
        ties = embedding_tie_groups(world_size, pp)
        assert ties == ([] if pp == 1 else [(p[0], p[-1]) for p in pipes])
        for stage in range(pp):
            ranks = stage_ranks(world_size, pp, stage)
            assert ranks == tuple(range(stage * per_stage, (stage + 1) * per_stage))
            for degree, consecutive in itertools.product(_divisors(per_stage), (True, False)):
                mp = model_parallel_groups(ranks, degree, consecutive)
                dp = data_parallel_groups(ranks, degree, consecutive)
                _assert_partition(mp, ranks, degree)
                _assert_partition(dp, ranks, per_stage // degree)
                for a, b in itertools.product(mp, dp):  # a grid: each tp group meets each dp group once
                    assert len(set(a) & set(b)) == 1
                stride = 1 if consecutive else per_stage // degree
                for group in mp:
                    assert all(y - x == stride for x, y in itertools.pairwise(group)), (group, stride)


def test_consecutive_and_strided_examples() -> None:
    ranks = tuple(range(8))
    assert model_parallel_groups(ranks, 2, True) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert model_parallel_groups(ranks, 2, False) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert data_parallel_groups(ranks, 2, True) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert data_parallel_groups(ranks, 2, False) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_bad_degrees_are_rejected() -> None:
    with pytest.raises(ValueError, match="degree=3 does not divide ranks per stage=8"):
        model_parallel_groups(tuple(range(8)), 3)
    with pytest.raises(ValueError, match="pp=3 does not divide world_size=8"):
        pipeline_groups(8, 3)


def _random_strategy(rng: random.Random, world_size: int) -> Strategy:
    pp = rng.choice(_divisors(world_size))
    per_stage = world_size // pp
    num_layers = pp * rng.randint(1, 3)
    layers = []
    for _ in range(num_layers):
        tp = rng.choice(_divisors(per_stage))
        layers.append(
            {
                "tp": tp,
                "tp_consecutive": rng.random() < 0.5,
                "ulysses": tp > 1 and rng.random() < 0.3,
                "dp_type": rng.choice(["ddp", "zero2", "zero3"]),
            }
        )
    vocab_tp = rng.choice(_divisors(per_stage))
    return Strategy.model_validate(
        {
            "world_size": world_size,
            "pp": pp,
            "global_batch_size": per_stage * 2,
            "megatron_sp": rng.random() < 0.5,
            "layers": layers,
            "vocab": {"tp": vocab_tp, "sp": vocab_tp > 1 and rng.random() < 0.3},
        }
    )


@pytest.mark.parametrize("world_size", [1, 2, 4, 6, 8, 12, 16, 32, 64])
def test_strategy_layout_groups(world_size: int) -> None:
    rng = random.Random(world_size)
    for _ in range(20):
        strategy = _random_strategy(rng, world_size)
        layout = RankLayout(strategy)
        for index, groups in enumerate(layout.layers):
            layer = strategy.layers[index]
            ranks = stage_ranks(world_size, strategy.pp, strategy.layer_stages[index])
            _assert_partition(groups.tp, ranks, layer.tp_degree)
            _assert_partition(groups.sp, ranks, layer.sp_degree)
            _assert_partition(groups.dp, ranks, strategy.layer_dp(index))
            _assert_partition(groups.shard, ranks, len(ranks) if layer.ulysses else strategy.layer_dp(index))
        all_groups = layout.all_groups()
        assert len(all_groups) == len(set(all_groups))
        assert all(len(g) > 1 for g in all_groups)


def _simulate(plan_source: ShardLayout, plan_target: ShardLayout) -> None:
    plan = redistribution_plan(plan_source, plan_target)
    cells = [(b, s) for b in range(plan.batch_cells) for s in range(plan.seq_cells)]
    held = {r: {c for c in cells if plan_source.holds(r, *_args(c, plan))} for r in plan_source.ranks}
    got: dict[int, set[tuple[int, int]]] = {r: set() for r in plan_target.ranks}
    for transfer in plan.transfers:
        assert set(transfer.cells) <= held[transfer.src], "a rank sends only what it holds"
        got[transfer.dst].update(transfer.cells)
        if transfer.src != transfer.dst:
            assert plan.group_of(transfer.src) == plan.group_of(transfer.dst)
    for rank in plan_target.ranks:
        need = {c for c in cells if plan_target.holds(rank, *_args(c, plan))}
        assert got[rank] == need
        local = [t for t in plan.receives(rank) if t.src == rank]
        assert all(set(t.cells) <= held[rank] for t in local)
    # no rank fetches remotely what it already holds
    for transfer in plan.transfers:
        if transfer.src != transfer.dst:
            assert not set(transfer.cells) & held[transfer.dst]


def _args(cell: tuple[int, int], plan: object) -> tuple[int, int, int, int]:
    return cell[0], plan.batch_cells, cell[1], plan.seq_cells  # type: ignore[attr-defined]


@pytest.mark.parametrize("stage_size", [1, 2, 4, 6, 8, 16])
def test_redistribution_plans_are_exact(stage_size: int) -> None:
    ranks = tuple(range(stage_size, 2 * stage_size))  # a stage that does not start at rank 0
    layouts = [
        ShardLayout(ranks, d, c, s)
        for d in _divisors(stage_size)
        for c in (True, False)
        for s in (False, True)
        if not (s and d == 1)
    ]
    for source, target in itertools.product(layouts, layouts):
        _simulate(source, target)


def test_split_is_local_and_gather_uses_tp_groups() -> None:
    ranks = tuple(range(4))
    tp4, dp4 = ShardLayout(ranks, 4), ShardLayout(ranks, 1)
    split = redistribution_plan(tp4, dp4)  # everyone holds the whole batch: keep a quarter, no communication
    assert local(split) and split.groups == ()
    gather = split.reverse()  # backward of the split is an all-gather over the whole stage
    assert gather.groups == ((0, 1, 2, 3),) and not local(gather)
    tp2 = ShardLayout(ranks, 2, consecutive=True)
    assert redistribution_plan(dp4, tp2).groups == ((0, 1), (2, 3))
    # strided tp2 groups (0,2) and (1,3) each need a half held by two dp ranks: everyone is connected
    assert redistribution_plan(dp4, ShardLayout(ranks, 2, consecutive=False)).groups == ((0, 1, 2, 3),)


def test_boundary_plans_follow_the_strategy() -> None:
    strategy = Strategy.model_validate(
        {
            "world_size": 8,
            "pp": 2,
            "global_batch_size": 8,
            "layers": [{"tp": 1}, {"tp": 2}, {"tp": 4}, {"tp": 2, "tp_consecutive": False}],
            "vocab": {"tp": 2},
        }
    )
    plans = dict(RankLayout(strategy).boundary_plans())
    assert sorted(plans) == [0, 1, 2, 3, 4]
    assert local(plans[0])  # vocab tp2 -> tp1: split
    assert plans[1].groups == ((0, 1), (2, 3))  # dp4 -> tp2 consecutive: gather in tp groups
    assert plans[2].groups == ((4, 6), (5, 7))  # across the stage boundary, tp2 -> tp4
    assert local(plans[3])  # tp4 -> tp2 strided: split
    assert plans[4].groups == ((4, 5), (6, 7))  # strided tp2 -> vocab consecutive tp2
    uniform = Strategy.uniform(world_size=4, num_layers=4, global_batch_size=4, layer={"tp": 2}, vocab={"tp": 2})
    assert list(RankLayout(uniform).boundary_plans()) == []


def test_all_groups_cover_backward_exchanges() -> None:
    # degree 2 replicated -> degree 2 strided and sequence-sharded: the backward plan needs the whole stage
    source, target = ShardLayout((0, 1, 2, 3), 2, True, False), ShardLayout((0, 1, 2, 3), 2, False, True)
    backward_groups = set(redistribution_plan(target, source).groups) - set(redistribution_plan(source, target).groups)
    assert backward_groups  # the case the layout must not miss
    # in a whole plan: vocab tp2 -> tp1 -> tp4; the backward of tp1 -> tp4 gathers over pairs no forward uses
    strategy = Strategy.model_validate(
        {"world_size": 8, "global_batch_size": 8, "layers": [{"tp": 1}, {"tp": 4}], "vocab": {"tp": 2}}
    )
    layout = RankLayout(strategy)
    groups = set(layout.all_groups())
    for _, plan in layout.boundary_plans():
        assert set(plan.groups) <= groups
        assert set(plan.reverse().groups) <= groups


def test_context_parallel_groups_and_shares() -> None:
    """tp 2 x cp 2 on 8 ranks: tp innermost, then the ring, then data parallelism; gradients are reduced over
    dp x cp; rank (tp i, cp r) holds chunks r and 3 - r of 4, split over tp under Megatron-SP."""
    strategy = Strategy.model_validate(
        {"world_size": 8, "global_batch_size": 8, "megatron_sp": True, "layers": [{"tp": 2, "cp": 2}, {"cp": 4}]}
    )
    layout = RankLayout(strategy)
    first, second = layout.layers
    assert first.tp == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert first.cp == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert first.dp == [(0, 4), (2, 6), (1, 5), (3, 7)]
    assert first.shard == [(0, 2, 4, 6), (1, 3, 5, 7)]
    share = first.activation
    assert [share.seq_blocks(r, 16) for r in (0, 1, 2, 3)] == [
        (slice(0, 4),), (slice(12, 16),), (slice(4, 8),), (slice(8, 12),)
    ]
    assert share.seq_blocks(1, 16, split=False) == (slice(0, 4), slice(12, 16))
    assert second.cp == [(0, 1, 2, 3), (4, 5, 6, 7)] and second.activation.seq_blocks(1, 16) == (
        slice(2, 4), slice(12, 14)
    )
    assert {(0, 2), (0, 1, 2, 3)} <= set(layout.all_groups())
    plans = dict(layout.boundary_plans())
    assert plans[1].source.cp == 2 and plans[1].target.cp == 4
    _simulate(plans[1].source, plans[1].target)


def test_expert_groups_follow_megatron_order() -> None:
    """edp x ep x etp over a stage's local ranks, etp fastest; each kind partitions the stage."""
    ep, etp, edp = expert_groups(tuple(range(8, 16)), 2, 2)
    assert etp == [(8, 9), (10, 11), (12, 13), (14, 15)]
    assert ep == [(8, 10), (9, 11), (12, 14), (13, 15)]
    assert edp == [(8, 12), (9, 13), (10, 14), (11, 15)]
    strategy = Strategy.uniform(world_size=8, num_layers=2, global_batch_size=8, pp=2, layer={"ep": 4})
    groups = RankLayout(strategy).layers[1]
    assert groups.of(GroupKind.EP, 5) == (4, 5, 6, 7) and groups.of(GroupKind.EDP, 5) == (5,)
    assert groups.of(GroupKind.WHOLE, 5) == (4, 5, 6, 7)
    assert (4, 5, 6, 7) in RankLayout(strategy).all_groups()
