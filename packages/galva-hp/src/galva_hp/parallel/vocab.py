"""Vocabulary parallelism: embedding and LM head split over the vocabulary (vocab tp), and the loss.

Padding. A vocabulary ``V`` not divisible by ``tp`` is padded to ``ceil(V/tp)*tp`` rows; rank ``r`` owns rows
``[r*V_pad/tp, (r+1)*V_pad/tp)`` of the padded table (:func:`vocab_range`), the padding rows are zero in both the
embedding and the head, are never looked up (token ids are ``< V``), and their logits are set to ``-inf`` before
the softmax, so padding changes neither the loss nor any gradient (the padding rows' gradient is exactly zero).
Embedding and head use the same rule, so tied shards hold the same rows.

Loss contract (see :class:`galva_hp.model.Parallelizer.head`): a head returns ``(loss_sum, token_count)`` over the
tokens *this rank is responsible for*; every token is owned by exactly one rank of the vocab tp group (with
Megatron-SP: the rank that holds its sequence slice; otherwise token ``i`` of the flattened ``[b, s]`` is owned by
tp rank ``i % tp``). Summing both over all ranks of the last stage gives the global sum and count, and
back-propagating ``loss_sum / global_count`` on every rank gives exactly the single-process gradient: the per-token
loss goes through ``differentiable_copy_to_group`` before the ownership mask, so each rank's cross-entropy backward
sees the gradient of every token. Labels equal to ``IGNORE_INDEX`` (-100) count neither in the sum nor in the count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.labels import IGNORE_INDEX
from galva_hp.parallel.mappings import (
    all_gather_along_dim,
    differentiable_copy_to_group,
    differentiable_reduce_from_group,
    differentiable_reduce_scatter,
    group_rank,
    group_size,
)
from galva_hp.parallel.tensor_parallel import (
    SEQ_DIM,
    column_parallel_linear,
    enter_tp_region,
    mark_tp_split,
    param_or_grad,
    sequence_parallel_norm,
)

__all__ = [
    "IGNORE_INDEX",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "padded_vocab_size",
    "token_loss_sum",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_loss_sum",
    "vocab_range",
]


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocabulary size rounded up to a multiple of ``tp``."""
    return -(-vocab_size // tp) * tp


def vocab_range(vocab_size: int, tp: int, rank: int) -> tuple[int, int, int]:
    """``(start, end, rows)``: rank ``rank`` owns real ids ``[start, end)`` and holds ``rows`` (>= end-start) rows."""
    rows = padded_vocab_size(vocab_size, tp) // tp
    start = rank * rows
    return start, max(start, min(start + rows, vocab_size)), rows


def _local_rows(weight: Tensor, tp: int, rank: int) -> Tensor:
    """This rank's rows of the padded ``[V, ...]`` table (zeros where padded)."""
    start, end, rows = vocab_range(weight.shape[0], tp, rank)
    local = torch.zeros((rows, *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
    local[: end - start] = weight[start:end].detach()
    return local


def token_loss_sum(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Single-process loss: ``(sum of token cross-entropies in fp32, number of non-ignored tokens)``."""
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (labels != IGNORE_INDEX).sum()


class VocabParallelEmbedding(nn.Module):
    """Embedding table split over the vocabulary of ``group``; output all-reduced, or reduce-scattered along the
    sequence when ``sequence_parallel`` (Megatron-SP), so the result is in the next layer's layout.

    Built from the full ``[V, hidden]`` weight; the parameter is ``weight`` (this rank's padded rows).
    """

    def __init__(self, weight: Tensor, group: ProcessGroup | None, sequence_parallel: bool = False) -> None:
        super().__init__()
        tp, rank = group_size(group), group_rank(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_size = weight.shape[0]
        self.start, self.end, _ = vocab_range(self.vocab_size, tp, rank)
        self.weight = nn.Parameter(_local_rows(weight, tp, rank))
        mark_tp_split(self.weight, dim=0, group=group)

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        """``{"weight": [V, hidden]}`` (padding dropped), or its gradient. Collective over the group."""
        return {"weight": _gather_rows(param_or_grad(self.weight, grads), self.group, self.vocab_size)}

    def forward(self, input_ids: Tensor) -> Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local_ids = (input_ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return differentiable_reduce_scatter(out, SEQ_DIM, self.group)
        return differentiable_reduce_from_group(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Memory-lean cross-entropy over vocabulary shards: keeps one fp32 softmax shard for the backward pass."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, labels: Tensor, group: ProcessGroup | None, vocab_start: int, vocab_end: int
    ) -> Tensor:
        probs = logits.float()  # fp32 entropy; a copy unless already fp32 (then cloned below before in-place use)
        if probs.data_ptr() == logits.data_ptr():
            probs = probs.clone()
        real = vocab_end - vocab_start
        if real < probs.shape[-1]:
            probs[..., real:] = float("-inf")  # padding rows: no probability mass
        global_max = probs.max(dim=-1, keepdim=True).values
        if group_size(group) > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        probs.sub_(global_max)
        mine = (labels >= vocab_start) & (labels < vocab_end)
        local_labels = (labels - vocab_start).masked_fill(~mine, 0)
        target = probs.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        probs.exp_()
        sum_exp = probs.sum(dim=-1)
        if group_size(group) > 1:
            both = torch.stack([sum_exp, target])
            dist.all_reduce(both, group=group)
            sum_exp, target = both[0], both[1]
        ignored = labels == IGNORE_INDEX
        loss = (torch.log(sum_exp) - target).masked_fill(ignored, 0.0)
        probs.div_(sum_exp.unsqueeze(-1))  # softmax shard, kept for the backward pass
        ctx.save_for_backward(probs, local_labels, mine & ~ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        probs, local_labels, hit = ctx.saved_tensors
        # d loss / d logit_j = softmax_j - [j == label]; ignored tokens have no gradient
        grad = probs  # reused in place: the softmax is not needed after this
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, labels: Tensor, group: ProcessGroup | None, vocab_start: int, vocab_end: int
) -> Tensor:
    """Per-token cross-entropy (fp32, ``labels.shape``) from logits split over the vocabulary of ``group``.

    ``logits[..., j]`` is vocabulary id ``vocab_start + j``; columns at or beyond ``vocab_end - vocab_start`` are
    padding and are excluded. Ignored labels (-100) get loss 0 and no gradient. The result is the same on every
    rank; its backward gives each rank the gradient of its own logits shard (no communication). Memory: one fp32
    softmax shard is kept between forward and backward.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, vocab_end)


class VocabParallelHead(nn.Module):
    """Final norm + LM head split over the vocabulary + vocab-parallel cross-entropy.

    ``(hidden, labels) -> (loss_sum, token_count)`` for the tokens this rank owns (module docstring). Plain tp:
    ``hidden`` and ``labels`` are the full sequence (replicated over the group). Megatron-SP: they are this rank's
    sequence slice; the norm runs on the slice (gradient summed over the group), then hidden is gathered.
    The head parameter is ``lm_head.weight`` (a megatron ``ColumnParallelLinear``, padded rows as the embedding).
    """

    def __init__(
        self,
        norm: nn.Module,
        weight: Tensor,
        group: ProcessGroup | None,
        sequence_parallel: bool = False,
        bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        tp, rank = group_size(group), group_rank(group)
        self.group, self.sequence_parallel, self.tp, self.rank = group, sequence_parallel, tp, rank
        self.vocab_size = weight.shape[0]
        self.start, self.end, _ = vocab_range(self.vocab_size, tp, rank)
        self.norm = sequence_parallel_norm(norm, group) if sequence_parallel else _copy(norm)
        local_bias = None if bias is None else _local_rows(bias, tp, rank)
        self.lm_head = column_parallel_linear(_local_rows(weight, tp, rank), local_bias, weight.shape[1], group)

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        """``norm.*`` and ``lm_head.weight`` (``[V, hidden]``, padding dropped) as in the single-process head, or
        their gradients. Collective over the group."""
        full = {
            "norm." + name.removeprefix("module."): param_or_grad(p, grads) for name, p in self.norm.named_parameters()
        }
        full["lm_head.weight"] = _gather_rows(param_or_grad(self.lm_head.weight, grads), self.group, self.vocab_size)
        if self.lm_head.bias is not None:
            full["lm_head.bias"] = _gather_rows(param_or_grad(self.lm_head.bias, grads), self.group, self.vocab_size)
        return full

    def forward(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        hidden = enter_tp_region(self.norm(hidden), self.group, self.sequence_parallel)
        logits = self.lm_head(hidden)[0]
        return vocab_parallel_loss_sum(logits, labels, self.group, self.vocab_size, self.sequence_parallel)


def vocab_parallel_loss_sum(
    logits: Tensor, labels: Tensor, group: ProcessGroup | None, vocab_size: int, sequence_parallel: bool
) -> tuple[Tensor, Tensor]:
    """``(loss_sum, token_count)`` over the tokens this rank owns (module docstring), from this rank's logits shard
    ``[b, s, V_pad/tp]`` of the whole sequence and its ``labels`` (its sequence slice under Megatron-SP)."""
    tp, rank = group_size(group), group_rank(group)
    start, end, _ = vocab_range(vocab_size, tp, rank)
    full_labels = all_gather_along_dim(labels, SEQ_DIM, group) if sequence_parallel else labels
    per_token = vocab_parallel_cross_entropy(logits, full_labels, group, start, end)
    per_token = differentiable_copy_to_group(per_token, group)
    owned = _owned(full_labels, tp, rank, sequence_parallel) & (full_labels != IGNORE_INDEX)
    return (per_token * owned).sum(), owned.sum()


def _owned(labels: Tensor, tp: int, rank: int, sequence_parallel: bool) -> Tensor:
    if tp == 1:
        return torch.ones_like(labels, dtype=torch.bool)
    if sequence_parallel:
        seq = labels.shape[SEQ_DIM]
        positions = torch.arange(seq, device=labels.device)
        local = seq // tp
        return ((positions >= rank * local) & (positions < (rank + 1) * local)).expand_as(labels)
    flat = torch.arange(labels.numel(), device=labels.device).view_as(labels)
    return flat % tp == rank


def _gather_rows(local: Tensor, group: ProcessGroup | None, vocab_size: int) -> Tensor:
    return all_gather_along_dim(local, 0, group)[:vocab_size]


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)
