"""Executing redistribution plans re-shards activations exactly, forward and backward, on real gloo ranks.

For every ordered pair of distinct layouts of a stage (every degree dividing the stage, consecutive and strided,
sequence-sharded or not) on 2, 4 and 8 ranks, and on the second stage (ranks 4-7) of an 8-rank world, each rank
feeds its source share of a known global tensor and must get exactly its target share; the backward pass must give
exactly its source share of the global upstream gradient (replicated copies carry the full gradient). Integer
tensors (token ids) take the same path without autograd. Tolerance: exact (pure data movement).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from galva_comm.groups import ProcessGroupCache
from galva_comm.shards import ShardLayout, redistribution_plan
from galva_hp.batch import shard_for
from galva_hp.parallel.redistribute import Redistribute, plan_groups, redistribute

BATCH, SEQ, HIDDEN = 8, 16, 3


def _layouts(ranks: tuple[int, ...], context: bool = False) -> list[ShardLayout]:
    """Every layout of a stage; with ``context``, every context-parallel degree too (two chunks per rank)."""
    found = []
    for degree in (d for d in range(1, len(ranks) + 1) if len(ranks) % d == 0):
        orders = (True, False) if 1 < degree < len(ranks) else (True,)
        seqs = (False, True) if degree > 1 else (False,)
        cps = [c for c in range(1, len(ranks) // degree + 1) if context or c == 1]
        for consecutive, seq_sharded, cp in itertools.product(orders, seqs, cps):
            if len(ranks) % (degree * cp) == 0:
                found.append(ShardLayout(ranks, degree, consecutive, seq_sharded, cp))
    return found


def _check_all_pairs(rank: int, world_size: int, stage: tuple[int, ...], context: bool = False) -> int:
    layouts = _layouts(stage, context)
    plans = [redistribution_plan(s, t) for s, t in itertools.permutations(layouts, 2)]
    cache = ProcessGroupCache()
    cache.create(plan_groups(plans))  # collective: every rank, same order
    if rank not in stage:
        return 0
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    grad = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    ids = torch.randint(0, 1000, (BATCH, SEQ), generator=gen)
    for plan in plans:
        where = f"rank {rank}: {plan.source} -> {plan.target}"
        x = shard_for(full, plan.source, rank, True).clone().requires_grad_()
        y = Redistribute(plan, rank, cache)(x)
        assert torch.equal(y, shard_for(full, plan.target, rank, True)), f"{where}: forward"
        y.backward(shard_for(grad, plan.target, rank, True))
        assert torch.equal(x.grad, shard_for(grad, plan.source, rank, True)), f"{where}: backward"
        moved = redistribute(shard_for(ids, plan.source, rank, True), plan, rank, cache)
        assert torch.equal(moved, shard_for(ids, plan.target, rank, True)), f"{where}: token ids"
    return len(plans)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "stage"), [(2, (0, 1)), (4, (0, 1, 2, 3)), (8, tuple(range(8))), (8, (4, 5, 6, 7))]
)
def test_every_layout_pair_is_exact(world_size: int, stage: tuple[int, ...]) -> None:
    from galva_comm.testing import run_distributed

    counts = run_distributed(_check_all_pairs, world_size, stage, timeout=180)
    expected = len(_layouts(stage)) * (len(_layouts(stage)) - 1)
    assert [c for r, c in enumerate(counts) if r in stage] == [expected] * len(stage)


@pytest.mark.distributed
def test_every_pair_of_context_parallel_layouts_is_exact() -> None:
    """cp 2 and 4 (each rank two chunks of the sequence, split again under Megatron-SP / Ulysses) against every
    other layout of 4 ranks: the boundary between two layers of different context-parallel degrees."""
    from galva_comm.testing import run_distributed

    stage = (0, 1, 2, 3)
    layouts = _layouts(stage, context=True)
    assert {layout.cp for layout in layouts} == {1, 2, 4}
    counts = run_distributed(_check_all_pairs, 4, stage, True, timeout=180)
    assert counts == [len(layouts) * (len(layouts) - 1)] * 4


def test_plan_groups_include_the_backward_groups() -> None:
    # splitting a replicated activation over the batch is local; its backward gathers over the tp pair
    plan = redistribution_plan(ShardLayout((0, 1), 2), ShardLayout((0, 1), 1))
    assert all(t.src == t.dst for t in plan.transfers)  # no rank needs another's data
    assert plan_groups([plan]) == [(0, 1)]
