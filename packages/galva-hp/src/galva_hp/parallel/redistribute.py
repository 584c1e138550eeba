"""Exact re-sharding of ``[batch, seq, ...]`` activations between two layers' layouts.

A :class:`galva_comm.layout.RedistributionPlan` cuts the micro-batch into a ``batch_cells x seq_cells`` grid that
refines both layouts and says which rank sends which cells to which. Executing it on one rank:

1. cut the local tensor (its share under ``plan.source``) into its cells;
2. copy the cells this rank keeps (``src == dst``) and exchange the others with one ``all_to_all_single`` inside
   ``plan.group_of(rank)`` (uneven split sizes, zero for peers it does not talk to; works on gloo and NCCL);
3. assemble the cells of its share under ``plan.target``.

Autograd: the backward pass executes ``plan.reverse()`` on the gradient. Replicated copies carry the full value
forward and the full gradient backward (the Megatron convention: every rank of a tp group holds the whole
gradient of a replicated activation), so the gradient a rank gets is its source share of the full gradient.

Process groups: the forward plan's groups *and* the reverse plan's (they can differ, e.g. a split has no group but
its reverse gathers) must exist in the cache; :func:`plan_groups` lists them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_comm.groups import ProcessGroupCache
from galva_comm.layout import Group
from galva_comm.shards import RedistributionPlan, ShardLayout

__all__ = ["Redistribute", "execute_plan", "plan_groups", "redistribute"]

GroupSource = Union[ProcessGroupCache, Callable[[Group], ProcessGroup]]


def plan_groups(plans: Iterable[RedistributionPlan]) -> list[Group]:
    """Every multi-rank group that executing ``plans`` forward and backward needs, sorted (size, ranks).

    Create them on every rank, in this order, before the first :func:`redistribute` (``ProcessGroupCache.create``).
    """
    found: set[Group] = set()
    for plan in plans:
        found.update(plan.groups)
        found.update(plan.reverse().groups)
    return sorted((g for g in found if len(g) > 1), key=lambda g: (len(g), g))


def _check_cells(size: int, cells: int, dim: str, what: str) -> None:
    if size % cells:
        raise ValueError(f"redistribution: the {dim} size {size} is not divisible by {cells} {what}")


def _get_group(groups: GroupSource, ranks: Group) -> ProcessGroup:
    if isinstance(groups, ProcessGroupCache):
        return groups.get(ranks)
    return groups(ranks)


def execute_plan(x: Tensor, plan: RedistributionPlan, rank: int, groups: GroupSource) -> Tensor:
    """Run ``plan`` on this rank's share ``x`` (no autograd; any dtype). Collective inside ``plan.group_of(rank)``."""
    source, target = plan.source, plan.target
    bc, sc = plan.batch_cells, plan.seq_cells
    src_batch = source.shard(rank)[0]
    dst_batch = target.shard(rank)[0]
    src_cells_b = bc // source.dp
    # sequence cells in each side's local order (a context-parallel share is two blocks of the sequence)
    src_seq = {cell: i for i, cell in enumerate(source.local_seq_cells(rank, sc))}
    dst_seq = {cell: i for i, cell in enumerate(target.local_seq_cells(rank, sc))}
    _check_cells(x.shape[0], src_cells_b, "local batch", "batch cells")
    _check_cells(x.shape[1], len(src_seq), "local sequence", "sequence cells")
    cb, cs = x.shape[0] // src_cells_b, x.shape[1] // len(src_seq)
    b0 = src_batch * src_cells_b  # first batch cell this rank holds under the source
    t_cells_b = bc // target.dp
    tb0 = dst_batch * t_cells_b
    out = x.new_empty((cb * t_cells_b, cs * len(dst_seq), *x.shape[2:]))
    cell_numel = cb * cs * math.prod(x.shape[2:])

    def cell_in(b: int, s: int) -> Tensor:
        return x[(b - b0) * cb : (b - b0 + 1) * cb, src_seq[s] * cs : (src_seq[s] + 1) * cs]

    def cell_out(b: int, s: int) -> Tensor:
        return out[(b - tb0) * cb : (b - tb0 + 1) * cb, dst_seq[s] * cs : (dst_seq[s] + 1) * cs]

    for transfer in plan.sends(rank):
        if transfer.dst == rank:
            for b, s in transfer.cells:
                cell_out(b, s).copy_(cell_in(b, s))

    members = plan.group_of(rank)
    if len(members) > 1:
        group = _get_group(groups, members)
        size = dist.get_world_size(group)
        send_counts, recv_counts = [0] * size, [0] * size
        send_parts: list[list[Tensor]] = [[] for _ in range(size)]
        recv_cells: list[tuple[tuple[int, int], ...]] = [() for _ in range(size)]
        for transfer in plan.sends(rank):
            if transfer.dst != rank:
                peer = dist.get_group_rank(group, transfer.dst)
                send_parts[peer] = [cell_in(b, s).reshape(-1) for b, s in transfer.cells]
                send_counts[peer] = cell_numel * len(transfer.cells)
        for transfer in plan.receives(rank):
            if transfer.src != rank:
                peer = dist.get_group_rank(group, transfer.src)
                recv_cells[peer] = transfer.cells
                recv_counts[peer] = cell_numel * len(transfer.cells)
        flat = [part for parts in send_parts for part in parts]
        send = torch.cat(flat) if flat else x.new_empty(0)
        recv = x.new_empty(sum(recv_counts))
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
        offset = 0
        for cells in recv_cells:
            for b, s in cells:
                cell_out(b, s).copy_(recv[offset : offset + cell_numel].view(cb, cs, *x.shape[2:]))
                offset += cell_numel
    return out


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, plan: RedistributionPlan, reverse: RedistributionPlan, rank: int, groups: Any
    ) -> Tensor:
        ctx.reverse, ctx.rank, ctx.groups = reverse, rank, groups
        return execute_plan(x, plan, rank, groups)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return execute_plan(grad.contiguous(), ctx.reverse, ctx.rank, ctx.groups), None, None, None, None


def redistribute(
    x: Tensor,
    plan: RedistributionPlan,
    rank: int,
    groups: GroupSource,
    reverse: RedistributionPlan | None = None,
) -> Tensor:
    """Re-shard ``x`` (this rank's share under ``plan.source``) to its share under ``plan.target``; differentiable
    (the backward executes ``reverse``, default ``plan.reverse()``). Integer tensors go through without autograd.
    ``groups``: the :class:`ProcessGroupCache` holding :func:`plan_groups`, or a ``ranks -> ProcessGroup`` callable.
    """
    if rank not in plan.source.ranks:
        raise ValueError(f"rank {rank} is not in the plan's stage {plan.source.ranks}")
    if not (x.requires_grad and torch.is_grad_enabled()):
        return execute_plan(x, plan, rank, groups)
    return _Redistribute.apply(x, plan, reverse or plan.reverse(), rank, groups)


class Redistribute(nn.Module):
    """Module form of :func:`redistribute` for one layer boundary (the reverse plan is computed once)."""

    def __init__(self, plan: RedistributionPlan, rank: int, groups: GroupSource) -> None:
        super().__init__()
        self.plan, self.reverse, self.rank, self.groups = plan, plan.reverse(), rank, groups

    def forward(self, x: Tensor) -> Tensor:
        return redistribute(x, self.plan, self.rank, self.groups, self.reverse)

    def extra_repr(self) -> str:
        s, t = self.plan.source, self.plan.target
        return f"{_describe(s)} -> {_describe(t)}"


def _describe(layout: ShardLayout) -> str:
    order = "consecutive" if layout.consecutive else "strided"
    cp = f" cp {layout.cp}" if layout.cp > 1 else ""
    return f"degree {layout.degree} {order}{' seq-sharded' if layout.seq_sharded else ''}{cp}"
