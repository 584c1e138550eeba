"""Tensor parallelism in place: a Hugging Face module keeps its name, class and place; only its parameters become
this rank's part and its forward gains the communication its table style needs (:data:`~.plans.STYLES`).

Every split parameter is tagged (:class:`Split`) so that :func:`gather_split` can put the single-process tensor
back together (checkpoints, tests), and with megatron's ``tensor_model_parallel`` attributes so that the runtime
counts it once in the gradient norm.

Entering a tp region (:class:`TpRegion`): a column-parallel module's input is the layer's activation, replicated
over tp (plain tp: its gradient is summed over tp in backward) or this rank's sequence slice (Megatron-SP: gathered
along the sequence, gradient reduce-scattered). The block holding column-parallel modules (attention, MLP) enters,
and blocks reading one tensor (a parallel attention + MLP layer) share one gather.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.parallel.mappings import (
    all_gather_along_dim,
    differentiable_all_gather,
    differentiable_copy_to_group,
    differentiable_gather_replicated,
    differentiable_reduce_from_group,
    differentiable_reduce_scatter,
    differentiable_split,
    group_rank,
    group_size,
    sum_grad_over,
)
from galva_hp.parallel.rng import rank_stream
from galva_hp.parallel.tensor_parallel import mark_tp_split
from galva_hp.parallel.vocab import vocab_range

__all__ = [
    "Split",
    "TpRegion",
    "enter_region_at",
    "gather_split",
    "shard_linear",
    "split_embedding",
    "split_per_head",
    "split_vocab_rows",
    "sum_where_sharded",
]

SEQ_DIM = 1


@dataclass(frozen=True)
class Split:
    """How a parameter is this rank's part of the single-process tensor."""

    dim: int
    group: ProcessGroup
    full: int
    """The single-process size along ``dim`` (without vocabulary padding)."""
    blocks: int = 1
    """Packed blocks along ``dim``, each split on its own (a fused gate/up projection: 2)."""


def _part(tensor: Tensor, dim: int, group: ProcessGroup, blocks: int) -> Tensor:
    tp, rank = group_size(group), group_rank(group)
    pieces = [b.chunk(tp, dim=dim)[rank] for b in tensor.chunk(blocks, dim=dim)]
    return torch.cat(pieces, dim=dim).detach().clone()


def _replace(module: nn.Module, name: str, value: Tensor, split: Split | None) -> None:
    old = getattr(module, name)
    param = nn.Parameter(value, requires_grad=old.requires_grad)
    if split is not None:
        param.galva_split = split  # type: ignore[attr-defined]
        mark_tp_split(param, split.dim, split.group)
    setattr(module, name, param)


def _check_divisible(what: str, size: int, parts: int) -> None:
    if size % parts:
        raise ValueError(f"{what}: {size} does not split over {parts} ranks")


class TpRegion:
    """Entering (and leaving) one layer's tensor-parallel region, with one gather per input tensor."""

    def __init__(self, group: ProcessGroup, sequence_parallel: bool) -> None:
        self.group, self.sequence_parallel = group, sequence_parallel
        self._last: tuple[Tensor, Tensor] | None = None
        self._gathered = False  # a gathered column-parallel output has been computed since the block entered

    def enter(self, x: Tensor) -> Tensor:
        if self._last is not None and self._last[0] is x:
            return self._last[1]
        if self.sequence_parallel:
            y = differentiable_all_gather(x, SEQ_DIM, self.group)
        else:
            y = differentiable_copy_to_group(x, self.group)
        self._last = (x, y)
        self._gathered = False
        return y

    def interior(self, x: Tensor) -> Tensor:
        """The input of a column-parallel module inside the block. After a gathered output (Qwen 3.5's gated
        delta-net: input projections gathered, then an output projection on what they computed), the module's input
        is whole on every rank while its gradient behind the shard is partial, and a gather's backward before it would
        take a slice of that partial gradient: the input enters here, so the gradient is summed first. Before any
        gather (or the block's own entered input) it stays as it is: a partial gradient flowing back only through the
        block's whole computation is summed once, where the block entered."""
        if not self._gathered or (self._last is not None and x is self._last[1]):
            return x
        return differentiable_copy_to_group(x, self.group)

    def gathered(self) -> None:
        """A column-parallel output was gathered back to every feature (``colwise_gather_output``)."""
        self._gathered = True

    def leave(self, partial: Tensor) -> Tensor:
        if self.sequence_parallel:
            return differentiable_reduce_scatter(partial, SEQ_DIM, self.group)
        return differentiable_reduce_from_group(partial, self.group)

    def clear(self) -> None:
        self._last = None


def enter_region_at(module: nn.Module, region: TpRegion) -> None:
    """``module`` (an attention or MLP block holding column-parallel modules, or a column-parallel head) takes its
    input into ``region``.

    The block, not each projection, enters: Hugging Face blocks shape their heads from their own input's sequence
    length, which under Megatron-SP must already be the whole sequence.
    """

    def hook(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if args:
            return (region.enter(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": region.enter(kwargs["hidden_states"])}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _transposed(module: nn.Module) -> bool:
    """A projection storing its weight ``[in, out]`` (transformers' ``Conv1D``: GPT-2, GPT-1)."""
    return type(module).__name__ == "Conv1D"


def shard_linear(
    linear: nn.Module,
    style: str,
    region: TpRegion,
    path: str,
    replicate: bool = False,
    blocks: int = 2,
    partial: bool = False,
) -> list[str]:
    """Put ``linear`` (an ``nn.Linear``, or a ``Conv1D`` storing its weight transposed) into ``style`` in place for
    ``region``'s group. ``replicate``: keep the weights whole although the style is column-parallel (key/value heads
    fewer than tp ranks: each rank picks the heads it needs in attention). ``blocks``: packed blocks of a
    ``packed_*`` style. ``partial``: a row-parallel output stays this rank's partial sum, which the family's hook
    sums later (Swin under Megatron-SP: after its window reverse). Returns the names of its parameters that stay
    replicated and whose gradient the runtime must sum over tp (a replicated column-parallel input's weights)."""
    transposed = _transposed(linear)
    if not (isinstance(linear, nn.Linear) or transposed):
        raise ValueError(f"{path}: tensor-parallel style {style!r} needs an nn.Linear, found {type(linear).__name__}")
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    group = region.group
    tp = group_size(group)
    blocks = blocks if style.startswith("packed_") else 1
    weight: Tensor = linear.weight  # type: ignore[assignment]
    if style in ("colwise", "colwise_gather_output", "packed_colwise"):  # the input enters at its block
        if replicate:
            return [n for n, _ in linear.named_parameters()]
        out_features = weight.shape[out_dim]
        _check_divisible(f"{path} output features", out_features, tp * blocks)
        _replace(linear, "weight", _part(weight, out_dim, group, blocks), Split(out_dim, group, out_features, blocks))
        if linear.bias is not None:
            bias: Tensor = linear.bias  # type: ignore[assignment]
            _replace(linear, "bias", _part(bias, 0, group, blocks), Split(0, group, out_features, blocks))
        if transposed:
            setattr(linear, "nf", out_features // tp)  # noqa: B010 - Conv1D shapes its output from nf
        linear.register_forward_pre_hook(lambda m, args: (region.interior(args[0]), *args[1:]))
        if style == "colwise_gather_output":

            def gather(module: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
                region.gathered()
                return differentiable_gather_replicated(out, -1, group)

            linear.register_forward_hook(gather)
        return []
    if style in ("rowwise", "rowwise_split_input", "packed_rowwise"):
        in_features = weight.shape[in_dim]
        _check_divisible(f"{path} input features", in_features, tp * blocks)
        _replace(linear, "weight", _part(weight, in_dim, group, blocks), Split(in_dim, group, in_features, blocks))
        split_input = style == "rowwise_split_input"
        forward = _rowwise_forward(region, split_input, transposed, partial)
        linear.forward = types.MethodType(forward, linear)
        return []
    raise ValueError(f"{path}: tensor-parallel style {style!r} is not one Galva runs")


def split_per_head(module: nn.Module, group: ProcessGroup, path: str) -> None:
    """The ``per_head`` style: each of ``module``'s own parameters holds one column per attention head (Swin's
    relative-position table ``[relative positions, heads]``); this rank keeps its heads' columns, so the module's
    own forward yields the bias of this rank's heads."""
    tp = group_size(group)
    for name, param in list(module.named_parameters(recurse=False)):
        dim = param.dim() - 1
        _check_divisible(f"{path}.{name} heads", param.shape[dim], tp)
        _replace(module, name, _part(param, dim, group, 1), Split(dim, group, param.shape[dim]))


def _rowwise_forward(region: TpRegion, split_input: bool, transposed: bool, partial: bool = False) -> Any:
    first = float(group_rank(region.group) == 0)

    def forward(self: nn.Module, x: Tensor) -> Tensor:
        if split_input:
            x = differentiable_split(x, -1, region.group)
        weight: Tensor = self.weight  # type: ignore[assignment]
        bias: Tensor | None = self.bias  # type: ignore[assignment]
        out = x @ weight if transposed else F.linear(x, weight)
        if partial:  # summed later: the bias once, on the first rank (kept in every rank's graph: a gradient to sum)
            return out if bias is None else out + bias * first
        out = region.leave(out)
        return out if bias is None else out + bias  # the bias once, after the sum

    return forward


def sum_where_sharded(block: nn.Module, styles: dict[str, str], group: ProcessGroup) -> None:
    """Inside a tp block (``styles``: its modules' styles, by path in the block), a replicated parameter used after a
    column-parallel module, before the data is whole again, sees only this rank's features (Qwen 3's qk-norm,
    Apertus's learned activation): its gradient is summed over tp. One after a gathered output (Olmo 2's qk-norm
    over every head) sees the whole data and is not. Followed call by call, since the order is the family's code. A
    dropout there (T5's feed-forward middle) draws this rank's own mask: its features are this rank's only."""
    sharded = [False]

    def reset(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        sharded[0] = False

    block.register_forward_pre_hook(reset, with_kwargs=True)
    for path, style in styles.items():
        after = style in ("colwise", "packed_colwise", "per_head")  # rowwise and gathered outputs: whole again

        def mark(module: nn.Module, args: tuple[Any, ...], out: Any, after: bool = after) -> None:
            sharded[0] = after

        block.get_submodule(path).register_forward_hook(mark)

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        if sharded[0]:
            for param in module.parameters(recurse=False):
                sum_grad_over(param, group)

    for path, sub in block.named_modules():
        if path and path not in styles and next(sub.parameters(recurse=False), None) is not None:
            sub.register_forward_pre_hook(record)
        if isinstance(sub, nn.Dropout):
            _own_mask_when_sharded(sub, sharded, group)


def _own_mask_when_sharded(dropout: nn.Dropout, sharded: list[bool], group: ProcessGroup) -> None:
    forward = dropout.forward

    def own(x: Tensor) -> Tensor:
        if not (sharded[0] and dropout.training and dropout.p > 0):
            return forward(x)
        with rank_stream(group, x.device):
            return forward(x)

    dropout.forward = own  # type: ignore[method-assign, assignment]


def split_vocab_rows(module: nn.Module, names: tuple[str, ...], group: ProcessGroup, vocab_size: int) -> None:
    """Replace ``module``'s parameters ``names`` (rows = vocabulary) by this rank's padded rows (galva-hp's
    vocabulary rule: :func:`galva_hp.parallel.vocab.vocab_range`; padding rows are zero)."""
    tp, rank = group_size(group), group_rank(group)
    start, end, rows = vocab_range(vocab_size, tp, rank)
    for name in names:
        full = getattr(module, name)
        if full is None:
            continue
        local = torch.zeros((rows, *full.shape[1:]), dtype=full.dtype, device=full.device)
        local[: end - start] = full.detach()[start:end]
        _replace(module, name, local, Split(0, group, vocab_size))


def split_embedding(embedding: nn.Module, group: ProcessGroup, sequence_parallel: bool, path: str) -> None:
    """A token embedding (``nn.Embedding`` or a subclass that scales its output) split over the vocabulary in place:
    ids outside this rank's rows look up zeros, and the output is summed over the group (reduce-scattered along
    the sequence under Megatron-SP)."""
    if not isinstance(embedding, nn.Embedding):
        raise ValueError(f"{path}: vocabulary tp needs an nn.Embedding, found {type(embedding).__name__}")
    vocab = embedding.num_embeddings
    tp, rank = group_size(group), group_rank(group)
    start, end, rows = vocab_range(vocab, tp, rank)
    split_vocab_rows(embedding, ("weight",), group, vocab)
    embedding.num_embeddings = rows
    pad = embedding.padding_idx
    embedding.padding_idx = pad - start if pad is not None and start <= pad < end else None
    outside: list[Tensor] = []

    def before(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        ids = args[0]
        mask = (ids < start) | (ids >= end)
        outside.append(mask)
        return ((ids - start).masked_fill(mask, 0), *args[1:])

    def after(module: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
        out = out.masked_fill(outside.pop().unsqueeze(-1), 0.0)
        if sequence_parallel:
            return differentiable_reduce_scatter(out, SEQ_DIM, group)
        return differentiable_reduce_from_group(out, group)

    embedding.register_forward_pre_hook(before)
    embedding.register_forward_hook(after)


def gather_split(value: Tensor, split: Split) -> Tensor:
    """The single-process tensor of a split parameter (or of its gradient). Collective over ``split.group``."""
    blocks = value.chunk(split.blocks, dim=split.dim)
    gathered = [all_gather_along_dim(b.contiguous(), split.dim, split.group) for b in blocks]
    full = torch.cat(gathered, dim=split.dim)
    return full.narrow(split.dim, 0, split.full)
