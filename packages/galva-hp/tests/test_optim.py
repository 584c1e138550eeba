"""The optimizer pieces: schedule shape, clipping formula, and the global norm counting replicas once."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from galva_comm.testing import run_distributed
from galva_hp import GalvaOptimizer, OptimConfig, lr_factor
from galva_hp.data_parallel import ParamRecord
from galva_hp.optim import clip_coefficient


def test_warmup_then_cosine() -> None:
    f = lr_factor(OptimConfig(warmup_steps=4, total_steps=14, min_lr_ratio=0.1))
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert lr_factor(OptimConfig(warmup_steps=0))(50) == 1.0


def test_clip_matches_torch() -> None:
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3, 3))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape) * 3
        b.grad = a.grad.clone()
    expected = float(torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    opt = GalvaOptimizer([ParamRecord(str(i), p, 1) for i, p in enumerate(ours)], OptimConfig(max_grad_norm=1.0))
    assert opt.clip_grad_norm() == pytest.approx(expected)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a.grad, b.grad)
    assert clip_coefficient(0.5, 1.0) == 1.0


def global_norm(rank: int, world_size: int) -> float:
    # a replicated parameter (same grad on all 4 ranks) and a 4-way shard
    replicated = nn.Parameter(torch.zeros(3))
    replicated.grad = torch.tensor([1.0, 2.0, 2.0])
    shard = nn.Parameter(torch.zeros(2))
    shard.grad = torch.full((2,), float(rank))
    records = [ParamRecord("r", replicated, 4), ParamRecord("s", shard, 1)]
    assert dist.get_world_size() == 4
    optimizer = GalvaOptimizer(records, OptimConfig())
    return optimizer.global_grad_norm()


@pytest.mark.distributed
def test_global_norm_counts_each_element_once() -> None:
    expected = math.sqrt(9.0 + 2 * (0 + 1 + 4 + 9))
    assert run_distributed(global_norm, 4, timeout=60) == [pytest.approx(expected)] * 4
