"""The optimizer pieces: schedule shape, clipping formula, and the global norm counting replicas once."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from galva_comm.testing import run_distributed
from galva_hp import GalvaOptimizer, OptimConfig, lr_factor
from galva_hp.data_parallel import ParamRecord, local_tensor
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


def global_norm(rank: int, world_size: int) -> tuple[float, dict[str, bool]]:
    # a replicated parameter (same grad on all 4 ranks) and a 4-way shard
    replicated = nn.Parameter(torch.zeros(3))
    replicated.grad = torch.tensor([1.0, 2.0, 2.0])
    shard = nn.Parameter(torch.zeros(2))
    shard.grad = torch.full((2,), float(rank))
    records = [ParamRecord("r", replicated, 4), ParamRecord("s", shard, 1)]
    assert dist.get_world_size() == 4
    optimizer = GalvaOptimizer(records, OptimConfig())
    return optimizer.global_grad_norm(), steps_like_torch(world_size)


def steps_like_torch(world_size: int) -> dict[str, bool]:
    """GalvaOptimizer's AdamW (multi-tensor, DTensors stepped through their local pieces) against torch's per-tensor
    AdamW on copies, 3 steps on plain and on DTensor parameters (rows sharded over the world, one rank's piece
    empty): bit for bit the same parameters and states, and the states of a DTensor are DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(3)
    values = [torch.randn(6, 4, generator=g), torch.randn(5, generator=g), torch.randn(3, 2, generator=g)]
    ours = [nn.Parameter(v.clone()) for v in values] + [
        nn.Parameter(distribute_tensor(v, mesh, [Shard(0)])) for v in values
    ]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    config = OptimConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=None)
    optimizer = GalvaOptimizer([ParamRecord(str(i), p, 1) for i, p in enumerate(ours)], config)
    reference = torch.optim.AdamW(
        theirs, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=0.1, foreach=False
    )
    for _ in range(3):
        for a, b in zip(ours, theirs):
            grad = torch.randn(a.shape, generator=g)
            a.grad = distribute_tensor(grad, mesh, [Shard(0)]) if isinstance(a, DTensor) else grad
            b.grad = a.grad.clone()
        optimizer.optimizer.step()
        reference.step()
    states = [(optimizer.optimizer.state[a], reference.state[b]) for a, b in zip(ours, theirs)]
    return {
        "params": all(torch.equal(local_tensor(a.detach()), local_tensor(b.detach())) for a, b in zip(ours, theirs)),
        "states": all(torch.equal(local_tensor(x[k]), local_tensor(y[k])) for x, y in states for k in x),
        "moved": all(
            not torch.equal(a.detach(), p.detach()) for a, p in zip(ours, values) if not isinstance(a, DTensor)
        ),
        "dtensor_states": all(
            isinstance(x["exp_avg"], DTensor) for (x, _), p in zip(states, ours) if isinstance(p, DTensor)
        ),
    }


@pytest.mark.distributed
def test_global_norm_counts_each_element_once_and_adamw_steps_like_torch() -> None:
    expected = math.sqrt(9.0 + 2 * (0 + 1 + 4 + 9))
    for norm, same in run_distributed(global_norm, 4, timeout=60):
        assert norm == pytest.approx(expected)
        assert same == {"params": True, "states": True, "moved": True, "dtensor_states": True}, same
