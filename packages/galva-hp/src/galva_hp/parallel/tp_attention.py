"""Megatron tensor-parallel self-attention (optionally Megatron-SP), made from the single-process weights.

GQA under tp: when ``kv_heads % tp == 0`` the K/V heads are split like the query heads; when ``tp % kv_heads == 0``
every rank computes only the K/V head its query heads use, from a K/V weight replicated over the tp group whose
gradient is summed over the group (as for the Megatron-SP norms); other combinations are rejected. Rotary
embeddings (:class:`~galva_hp.parallel.attention.Rotary`) are applied to the full sequence of the local heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.parallel.attention import HeldHeadsAttention, Rotary
from galva_hp.parallel.gather_state import param_or_grad
from galva_hp.parallel.mappings import (
    all_gather_along_dim,
    differentiable_copy_to_group,
    group_rank,
    group_size,
)
from galva_hp.parallel.tp_regions import (
    column_parallel_linear,
    enter_tp_region,
    mark_sequence_parallel,
    row_output,
    row_parallel_linear,
    shard,
)
from galva_schema.constraints import heads_problem

__all__ = ["TensorParallelAttention"]


class TensorParallelAttention(HeldHeadsAttention):
    """Megatron tensor-parallel self-attention (optionally Megatron-SP), made from full single-process weights.

    q/k/v weights are ``[heads*d, hidden]`` / ``[kv_heads*d, hidden]`` (``nn.Linear`` layout), ``o_weight`` is
    ``[hidden, heads*d]``. This rank keeps query heads ``[r*heads/tp, (r+1)*heads/tp)`` in one fused
    column-parallel ``qkv`` (its local rows are ``[q_r; k_r; v_r]``) and the matching input columns of the
    row-parallel ``o_proj``. ``rotary`` (if any) is applied to the full sequence of the local heads. ``causal=False``
    drops the causal mask (bidirectional encoders such as BERT and ViT); ``window`` restricts causal attention to a
    sliding window of that many keys (Mistral, Qwen2), on the full sequence. ``dropout``: attention-probability
    dropout in training; this rank holds its own heads, so it draws from its own stream (:mod:`.rng`).
    """

    def __init__(
        self,
        q_weight: Tensor,
        k_weight: Tensor,
        v_weight: Tensor,
        o_weight: Tensor,
        q_bias: Tensor | None = None,
        k_bias: Tensor | None = None,
        v_bias: Tensor | None = None,
        o_bias: Tensor | None = None,
        *,
        heads: int,
        kv_heads: int,
        group: ProcessGroup,
        sequence_parallel: bool = False,
        rotary: Rotary | None = None,
        causal: bool = True,
        window: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        if len({b is None for b in (q_bias, k_bias, v_bias)}) > 1:
            raise ValueError("q_bias, k_bias and v_bias must be given together or not at all")
        super().__init__(rotary, causal, window, dropout)
        tp, rank = group_size(group), group_rank(group)
        if problem := heads_problem(heads, kv_heads, tp, ulysses=False):
            raise ValueError(problem)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.head_dim = q_weight.shape[0] // heads
        self.local_heads = heads // tp
        hidden = q_weight.shape[1]
        d = self.head_dim
        q_w = shard(q_weight, 0, rank, tp)
        q_b = None if q_bias is None else shard(q_bias, 0, rank, tp)
        self.kv_head: int | None
        self.kv_weight: nn.Parameter | None
        self.kv_bias: nn.Parameter | None
        if kv_heads % tp == 0:
            self.local_kv_heads = kv_heads // tp
            self.kv_head = None  # K/V split with the query heads
            rows = [q_w, shard(k_weight, 0, rank, tp), shard(v_weight, 0, rank, tp)]
            biases = [q_b] + [None if b is None else shard(b, 0, rank, tp) for b in (k_bias, v_bias)]
            self.kv_weight = None
            self.kv_bias = None
        else:  # tp % kv_heads == 0 (heads_problem refused the rest)
            # each rank's query heads use one K/V head; compute just that one, from a replicated K/V weight
            self.local_kv_heads = 1
            self.kv_head = (rank * self.local_heads) // (heads // kv_heads)
            rows, biases = [q_w], [q_b]
            self.kv_weight = nn.Parameter(torch.cat([k_weight, v_weight]).detach().clone())
            mark_sequence_parallel(self.kv_weight)
            if k_bias is not None and v_bias is not None:
                self.kv_bias = nn.Parameter(torch.cat([k_bias, v_bias]).detach().clone())
                mark_sequence_parallel(self.kv_bias)
            else:
                self.kv_bias = None
            self._kv_rows = torch.cat(
                [
                    torch.arange(self.kv_head * d, (self.kv_head + 1) * d),
                    torch.arange((kv_heads + self.kv_head) * d, (kv_heads + self.kv_head + 1) * d),
                ]
            )
        has_bias = q_bias is not None
        local_bias = torch.cat([b for b in biases if b is not None]) if has_bias else None
        self.qkv = column_parallel_linear(torch.cat(rows).detach(), local_bias, hidden, group)
        self.o_proj = row_parallel_linear(shard(o_weight, 1, rank, tp).detach(), o_bias, group)

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        """Full single-process tensors (``q_proj.weight`` ... ``o_proj.bias``) assembled over the tp group, or their
        gradients with ``grads=True``. Collective over the tp group."""
        d, hq, hkv = self.head_dim, self.local_heads, self.local_kv_heads
        g = self.group
        full: dict[str, Tensor] = {}
        qkv_w, qkv_b = param_or_grad(self.qkv.weight, grads), param_or_grad(self.qkv.bias, grads)
        if self.kv_weight is None:
            for name, part in zip(("q", "k", "v"), qkv_w.split([hq * d, hkv * d, hkv * d])):
                full[f"{name}_proj.weight"] = all_gather_along_dim(part, 0, g)
            if qkv_b is not None:
                for name, part in zip(("q", "k", "v"), qkv_b.split([hq * d, hkv * d, hkv * d])):
                    full[f"{name}_proj.bias"] = all_gather_along_dim(part, 0, g)
        else:
            full["q_proj.weight"] = all_gather_along_dim(qkv_w, 0, g)
            full["k_proj.weight"], full["v_proj.weight"] = param_or_grad(self.kv_weight, grads).chunk(2)
            if qkv_b is not None:
                full["q_proj.bias"] = all_gather_along_dim(qkv_b, 0, g)
            if self.kv_bias is not None:  # present exactly when qkv_b is (biases come all or none)
                full["k_proj.bias"], full["v_proj.bias"] = param_or_grad(self.kv_bias, grads).chunk(2)
        full["o_proj.weight"] = all_gather_along_dim(param_or_grad(self.o_proj.weight, grads), 1, g)
        if self.o_proj.bias is not None:
            full["o_proj.bias"] = param_or_grad(self.o_proj.bias, grads)
        return full

    def forward(self, x: Tensor) -> Tensor:
        x = enter_tp_region(x, self.group, self.sequence_parallel)
        b, s = x.shape[:2]
        d, hq, hkv = self.head_dim, self.local_heads, self.local_kv_heads
        qkv = self.qkv(x)[0]
        if self.kv_weight is None:
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        else:
            rows = self._kv_rows.to(x.device)
            kv_w = differentiable_copy_to_group(self.kv_weight, self.group)[rows]
            kv_b = None if self.kv_bias is None else differentiable_copy_to_group(self.kv_bias, self.group)[rows]
            q = qkv
            k, v = F.linear(x, kv_w, kv_b).split([d, d], dim=-1)
        q, k, v = q.view(b, s, hq, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d)
        out = self.attend(q, k, v, self.group).reshape(b, s, hq * d)
        return row_output(self.o_proj, out, self.sequence_parallel)
