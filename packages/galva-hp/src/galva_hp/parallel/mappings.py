"""Collectives with an explicit process group, correct on gloo (CPU) and NCCL alike: plain ones and autograd ones.

Megatron's own sequence-parallel and gather paths allocate buffers on ``torch.cuda.current_device()`` and fail on
CPU, and ``torch.distributed.nn.functional.all_gather`` breaks in gloo subgroups that do not contain rank 0, so
Galva uses these instead. Every function takes the group explicitly and is the identity when the group is ``None``
or has one rank.

Gloo accepts only the "concatenated along dim 0" layout for ``all_gather_into_tensor`` and
``reduce_scatter_tensor``: a collective along another dim moves that dim to the front, makes the tensor contiguous,
runs, and moves it back.

Names say which is which: the ``differentiable_*`` functions are autograd functions (forward and backward below);
``all_reduce_sum``, ``all_gather_along_dim``, ``reduce_scatter_along_dim``, ``chunk_along_dim`` and
``all_to_all_along`` (``all_to_all_many``) are plain collectives on tensors, outside autograd.

================================  ==========================  ==========================
autograd function                 forward                     backward
================================  ==========================  ==========================
differentiable_copy_to_group      identity                    all-reduce (sum)
differentiable_reduce_from_group  all-reduce (sum)            identity
differentiable_all_gather         all-gather along ``dim``    reduce-scatter along ``dim``
differentiable_reduce_scatter     reduce-scatter along dim    all-gather along ``dim``
differentiable_split              keep this rank's chunk      all-gather along ``dim``
differentiable_all_to_all         scatter one dim, gather     the inverse all-to-all
                                  another (``_many``: several
                                  tensors, one collective)
differentiable_gather_replicated  all-gather along ``dim``    keep this rank's chunk
differentiable_all_to_all_uneven  rows to each rank, uneven   the same exchange reversed
================================  ==========================  ==========================

``differentiable_copy_to_group`` applied to a *parameter* inside ``forward`` makes autograd sum that parameter's
gradient over the group: this is how parameters replicated over a tensor-parallel group but used on a sequence
shard (Megatron-SP norms, row-parallel biases, position embeddings) get their full gradient. Under
:func:`defer_param_grad_sums` (the runtime's iterations) that sum is left to the runtime, once per iteration.
:func:`sum_grad_over` asks for the same once-per-iteration sum without passing the parameter through a function
(modules parallelized in place, whose forward is the model's own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

__all__ = [
    "all_gather_along_dim",
    "all_reduce_sum",
    "all_to_all_along",
    "all_to_all_many",
    "all_to_all_uneven",
    "chunk_along_dim",
    "differentiable_all_gather",
    "differentiable_all_to_all",
    "differentiable_all_to_all_many",
    "differentiable_all_to_all_uneven",
    "differentiable_copy_to_group",
    "differentiable_gather_replicated",
    "differentiable_reduce_from_group",
    "differentiable_reduce_scatter",
    "differentiable_split",
    "group_rank",
    "group_size",
    "reduce_scatter_along_dim",
    "sum_grad_over",
]

def _all_gather_flat(out: Tensor, x: Tensor, group: ProcessGroup | None) -> None:
    # the *_single names are the non-deprecated spellings in recent torch; older torch only has the *_tensor ones.
    # Looked up per call: the watchdog and galva-profile's CPU meter wrap torch.distributed's functions.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_flat(out: Tensor, x: Tensor, group: ProcessGroup | None) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's index in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def _check_divisible(size: int, parts: int, dim: int, what: str) -> None:
    if size % parts:
        raise ValueError(f"{what}: dim {dim} has size {size}, not divisible by the group size {parts}")


# ----------------------------------------------------------------------------- plain (non-autograd) collectives
def all_reduce_sum(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum of ``x`` over the group (a new tensor; ``x`` is left alone)."""
    out = x.clone(memory_format=torch.contiguous_format)
    if group_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


def all_gather_along_dim(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Concatenation along ``dim`` of every rank's ``x`` (equal shapes), in group-rank order."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] * n, *front.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_flat(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_along_dim(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Sum over the group of ``x``, of which this rank keeps its ``1/n`` chunk along ``dim``."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    _check_divisible(x.shape[dim], n, dim, "reduce-scatter")
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // n, *front.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def chunk_along_dim(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """This rank's ``1/n`` chunk of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x.shape[dim], n, dim, "split")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def all_to_all_along(x: Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None) -> Tensor:
    """Split ``x`` into ``n`` chunks along ``scatter_dim``, send chunk ``j`` to rank ``j``, and concatenate the
    received chunks along ``gather_dim`` in group-rank order."""
    return all_to_all_many([x], scatter_dim, gather_dim, group)[0]


def all_to_all_many(
    xs: Sequence[Tensor], scatter_dim: int, gather_dim: int, group: ProcessGroup | None
) -> list[Tensor]:
    """:func:`all_to_all_along` of every tensor of ``xs`` (one dtype, any shapes) in one collective: each rank's
    chunks of all of them travel in one message (Ulysses' q, k and v: one exchange instead of three)."""
    n = group_size(group)
    if n == 1:
        return list(xs)
    sends = []
    for x in xs:
        nd = x.dim()
        dim = scatter_dim % nd
        _check_divisible(x.shape[dim], n, dim, "all-to-all")
        # [..., n, c, ...] at scatter_dim, then the n axis to the front: chunk j is then the j-th slab of dim 0
        sends.append(x.unflatten(dim, (n, -1)).movedim(dim, 0))
    send = torch.cat([t.reshape(n, -1) for t in sends], dim=1) if len(sends) > 1 else sends[0].contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    pieces = recv.split([t[0].numel() for t in sends], dim=1) if len(sends) > 1 else [recv]
    out = []
    for piece, shape, x in zip(pieces, (t.shape for t in sends), xs):
        # piece[j] is rank j's chunk, shaped like x with scatter_dim shrunk; the rank axis just before gather_dim
        dim = gather_dim % x.dim()
        out.append(piece.reshape(shape).movedim(0, dim).flatten(dim, dim + 1).contiguous())
    return out


def all_to_all_uneven(x: Tensor, send: list[int], receive: list[int], group: ProcessGroup | None) -> Tensor:
    """Send the first ``send[0]`` rows of ``x`` to group rank 0, the next ``send[1]`` to rank 1, ...; receive
    ``receive[j]`` rows from rank ``j``, concatenated in group-rank order."""
    if group_size(group) == 1:
        return x
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
    return out


# ------------------------------------------------------------------- replicated parameters: deferred gradient sums
class DeferredGradSums:
    """Parameters whose gradient :func:`differentiable_copy_to_group` left as a per-rank partial sum.

    Summing a replicated parameter's gradient inside autograd costs one all-reduce per micro-batch; the runtime
    (:meth:`galva_hp.build.HybridParallelModel.forward_backward`) runs its forwards under
    :func:`defer_param_grad_sums` instead and sums the accumulated gradients of :attr:`params` over their groups
    once per iteration. Standalone use of a parallel block (no deferral active) keeps the per-backward sum.
    """

    def __init__(self) -> None:
        self.params: dict[int, tuple[nn.Parameter, ProcessGroup]] = {}  # id(param) -> (param, group)


_ACTIVE: DeferredGradSums | None = None


@contextmanager
def defer_param_grad_sums(record: DeferredGradSums) -> Iterator[DeferredGradSums]:
    """While active, ``differentiable_copy_to_group(param, group)`` on an ``nn.Parameter`` records it in ``record``
    and its backward leaves the gradient unsummed (activations are summed as always)."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, record
    try:
        yield record
    finally:
        _ACTIVE = previous


def _defer_param(x: Tensor, group: ProcessGroup | None) -> bool:
    if _ACTIVE is None or group is None or not isinstance(x, nn.Parameter):
        return False
    _ACTIVE.params[id(x)] = (x, group)
    return True


def sum_grad_over(param: nn.Parameter, group: ProcessGroup | None) -> None:
    """Have the runtime sum ``param``'s accumulated gradient over ``group`` once per iteration.

    Called from a forward (with the parameter object that forward uses, e.g. FSDP2's gathered one). Outside the
    runtime's iterations (a layer timed alone by the profiler) nothing sums it: the gradient stays this rank's part.
    """
    if _ACTIVE is not None and group is not None and group_size(group) > 1:
        _ACTIVE.params[id(param)] = (param, group)


# ----------------------------------------------------------------------------------------- autograd functions
_DimOp = Callable[[Tensor, int, ProcessGroup | None], Tensor]


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        ctx.deferred = _defer_param(x, group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if ctx.deferred:  # the runtime sums the accumulated gradient once per iteration instead
            return grad, None
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _AlongDim(torch.autograd.Function):
    """Forward ``forward_op(x, dim, group)``, backward ``backward_op(grad, dim, group)``: the along-``dim`` pairs
    (gather / reduce-scatter, reduce-scatter / gather, split / gather, gather / split) differ only in the two ops."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, dim: int, group: ProcessGroup | None, forward_op: _DimOp, backward_op: _DimOp
    ) -> Tensor:
        ctx.dim, ctx.group, ctx.backward_op = dim, group, backward_op
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None) -> Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all_along(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return all_to_all_along(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class _AllToAllMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, scatter_dim: int, gather_dim: int, group: ProcessGroup | None, *xs: Tensor) -> Any:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return tuple(all_to_all_many(xs, scatter_dim, gather_dim, group))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:  # an unused output's gradient comes as zeros (materialized)
        scatter_dim, gather_dim = ctx.dims
        return None, None, None, *all_to_all_many(grads, gather_dim, scatter_dim, ctx.group)


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], receive: list[int], group: ProcessGroup | None) -> Tensor:
        ctx.splits, ctx.group = (send, receive), group
        return all_to_all_uneven(x, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        send, receive = ctx.splits
        return all_to_all_uneven(grad, receive, send, ctx.group), None, None, None


def _trivial(group: ProcessGroup | None) -> bool:
    return group_size(group) == 1


def differentiable_copy_to_group(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Forward identity, backward all-reduce (sum) of the gradient over ``group``."""
    return x if _trivial(group) else _CopyToGroup.apply(x, group)


def differentiable_reduce_from_group(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Forward all-reduce (sum) over ``group``, backward identity."""
    return x if _trivial(group) else _ReduceFromGroup.apply(x, group)


def differentiable_all_gather(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Forward all-gather along ``dim``; backward reduce-scatter (sum) along ``dim``.

    The backward sums because the consumer (a column-parallel linear) leaves a partial gradient on every rank.
    """
    return x if _trivial(group) else _AlongDim.apply(x, dim, group, all_gather_along_dim, reduce_scatter_along_dim)


def differentiable_reduce_scatter(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Forward reduce-scatter (sum) along ``dim``; backward all-gather along ``dim``."""
    return x if _trivial(group) else _AlongDim.apply(x, dim, group, reduce_scatter_along_dim, all_gather_along_dim)


def _own_chunk(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """:func:`chunk_along_dim` in storage of its own: a chunk that is already contiguous (a batch of 1 split along
    the sequence) would be a view, and autograd saving it would keep the whole ``x`` alive."""
    part = chunk_along_dim(x, dim, group)
    return part.clone() if part.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else part


def differentiable_split(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Forward: keep this rank's ``1/n`` chunk along ``dim`` (its own copy); backward all-gather along ``dim``."""
    return x if _trivial(group) else _AlongDim.apply(x, dim, group, _own_chunk, all_gather_along_dim)


def differentiable_all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None) -> Tensor:
    """Forward :func:`all_to_all_along`; backward the inverse all-to-all (scatter ``gather_dim``, gather
    ``scatter_dim``)."""
    return x if _trivial(group) else _AllToAll.apply(x, scatter_dim, gather_dim, group)


def differentiable_all_to_all_many(
    xs: Sequence[Tensor], scatter_dim: int, gather_dim: int, group: ProcessGroup | None
) -> tuple[Tensor, ...]:
    """:func:`differentiable_all_to_all` of every tensor of ``xs`` in one collective each way
    (:func:`all_to_all_many`)."""
    return tuple(xs) if _trivial(group) else _AllToAllMany.apply(scatter_dim, gather_dim, group, *xs)


def differentiable_gather_replicated(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Forward all-gather along ``dim``; backward keeps this rank's chunk of the gradient.

    For a gathered result that every rank then uses identically (a column-parallel output gathered back to the
    whole feature dimension): each rank's gradient is already the whole gradient, so no sum is needed.
    """
    return x if _trivial(group) else _AlongDim.apply(x, dim, group, all_gather_along_dim, chunk_along_dim)


def differentiable_all_to_all_uneven(
    x: Tensor, send: list[int], receive: list[int], group: ProcessGroup | None
) -> Tensor:
    """Forward :func:`all_to_all_uneven` (rows of ``x`` to each group rank by ``send``, rows received by
    ``receive``); backward the same exchange with the splits swapped (token dispatch and combine of experts)."""
    return x if _trivial(group) else _AllToAllUneven.apply(x, send, receive, group)
