"""A parallel form's overhead is its own CPU, not its collectives' (those are priced from the hardware profile)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from galva_comm.testing import run_distributed
from galva_profiler.layer_timing import CollectiveCpu, cpu_passes


class _Gathering(nn.Module):
    """A sequence-parallel layer's shape of work: galva-hp's all-gather forward, reduce-scatter backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from galva_hp.parallel.mappings import differentiable_all_gather

        return differentiable_all_gather(x, 1, dist.group.WORLD)


def _overheads(rank: int, world: int) -> dict[str, float]:
    torch.set_num_threads(1)
    before = dist.all_reduce
    with CollectiveCpu() as calls:
        start = time.thread_time()
        for _ in range(20):
            dist.all_reduce(torch.ones(1024))
        total = time.thread_time() - start
    restored = dist.all_reduce is before
    with CollectiveCpu() as none:
        torch.ones(1024).sum()
    forward, backward = cpu_passes(_Gathering(), 2, 8, 16, torch.float32)
    with CollectiveCpu() as gathered:
        out = _Gathering()(torch.randn(2, 8, 16, requires_grad=True))
        out.backward(torch.ones_like(out))
    return {
        "metered": calls.seconds,
        "total": total,
        "restored": float(restored),
        "none": none.seconds,
        "gathered": gathered.seconds,
        "forward": forward,
        "backward": backward,
    }


@pytest.mark.distributed
def test_the_collectives_own_cpu_is_metered_and_left_out_of_a_form_s_passes() -> None:
    for got in run_distributed(_overheads, 2, timeout=60):
        assert 0.0 < got["metered"] <= got["total"]  # inside the block: every call's CPU, and no more than all
        assert got["restored"] == 1.0 and got["none"] == 0.0
        # galva-hp's mappings look torch.distributed's functions up per call: the meter sees the gather and the
        # backward's reduce-scatter
        assert got["gathered"] > 0.0
        assert got["forward"] >= 0.0 and got["backward"] >= 0.0
