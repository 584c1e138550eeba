"""Megatron tensor parallelism (and Megatron-SP) built from megatron-core layers with an explicit ``tp_group``.

Every block is made *from the single-process weights*: it copies this rank's shard, so a converted model computes
the same function as the original. Activations are ``[batch, seq, hidden]``.

Regions. A tensor-parallel block turns a replicated (or, with Megatron-SP, sequence-sharded) input into a result of
the same layout:

- plain tp: ``copy_to_group`` on entry (backward all-reduce of the partial input gradient), all-reduce on exit;
- Megatron-SP: all-gather along the sequence on entry (backward reduce-scatter), reduce-scatter along the sequence
  on exit (backward all-gather).

megatron's ``sequence_parallel=True`` path allocates CUDA buffers, so megatron layers are always built with
``sequence_parallel=False`` and ``disable_grad_reduce=True`` and the region mappings of :mod:`.mappings` do the
communication; the matmuls are megatron's.

Parameters replicated over the tp group but applied to a sequence shard (norm weights, the row-parallel bias under
Megatron-SP) pass through ``copy_to_group`` inside ``forward``: autograd sums their gradient over the tp group, so
every tp rank ends the backward pass with the full, identical gradient and the runtime needs no extra hook. They are
tagged ``param.galva_sequence_parallel = True`` for information only (do **not** reduce them again over tp).

GQA under tp: when ``kv_heads % tp == 0`` the K/V heads are split like the query heads; when ``tp % kv_heads == 0``
every rank computes only the K/V head its query heads use, from a K/V weight replicated over the tp group whose
gradient is summed over the group (as above); other combinations are rejected.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, overload, runtime_checkable

import torch
import torch.nn.functional as F
from megatron.core import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, set_tensor_model_parallel_attributes
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.parallel.attention import Rotary, attention
from galva_hp.parallel.mappings import (
    all_gather_along_dim,
    copy_to_group,
    gather_along_dim,
    group_rank,
    group_size,
    reduce_from_group,
    reduce_scatter_along,
)

__all__ = [
    "SEQ_DIM",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
    "TensorParallelAttention",
    "TensorParallelMLP",
    "column_parallel_linear",
    "enter_tp_region",
    "exit_tp_region",
    "gather_full_state",
    "mark_sequence_parallel",
    "megatron_config",
    "param_or_grad",
    "row_parallel_linear",
    "sequence_parallel_norm",
    "shard",
]

SEQ_DIM = 1  # activations are [batch, seq, hidden]


def megatron_config(dtype: torch.dtype = torch.float32) -> ModelParallelConfig:
    """The megatron-core config Galva builds its layers with (CPU-safe: no CUDA init, no fused kernels)."""
    return ModelParallelConfig(
        use_cpu_initialization=True,
        perform_initialization=False,  # weights are copied from the single-process module
        sequence_parallel=False,  # Galva's own mappings do Megatron-SP (megatron's path needs CUDA buffers)
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
    )


def shard(tensor: Tensor, dim: int, rank: int, parts: int) -> Tensor:
    """The ``rank``-th of ``parts`` equal slices of ``tensor`` along ``dim``."""
    if tensor.shape[dim] % parts:
        raise ValueError(f"cannot split size {tensor.shape[dim]} (dim {dim}) into {parts} equal tensor-parallel shards")
    return tensor.chunk(parts, dim=dim)[rank]


def mark_sequence_parallel(param: Tensor) -> Tensor:
    setattr(param, "galva_sequence_parallel", True)  # noqa: B010 - an attribute torch parameters do not declare
    return param


def mark_tp_split(param: Tensor, dim: int, group: ProcessGroup | None) -> None:
    """Tag a parameter that holds this rank's shard along ``dim`` (megatron's ``tensor_model_parallel`` attributes).

    The runtime counts such parameters once per tp rank in the global gradient norm and never reduces their
    gradients over tp. Layers built with ``perform_initialization=False`` skip megatron's own tagging, hence this.
    """
    if group_size(group) > 1:
        set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


_Linear = TypeVar("_Linear", ColumnParallelLinear, RowParallelLinear)


def column_parallel_linear(
    local_weight: Tensor, local_bias: Tensor | None, input_size: int, group: ProcessGroup | None
) -> ColumnParallelLinear:
    """A megatron ``ColumnParallelLinear`` holding ``local_weight`` (``[out/tp, in]``), with no communication of its
    own (the caller enters the tp region). ``group=None`` is a single rank (tp 1)."""
    tp = group_size(group)
    layer = ColumnParallelLinear(
        input_size,
        local_weight.shape[0] * tp,
        config=megatron_config(local_weight.dtype),
        init_method=nn.init.zeros_,
        bias=local_bias is not None,
        gather_output=False,
        skip_bias_add=False,
        disable_grad_reduce=True,
        tp_group=group,
    )
    return _load_shard(layer, local_weight, local_bias, split_dim=0, group=group)


def row_parallel_linear(local_weight: Tensor, bias: Tensor | None, group: ProcessGroup) -> RowParallelLinear:
    """A megatron ``RowParallelLinear`` holding ``local_weight`` (``[out, in/tp]``) and the full ``bias``."""
    tp = group_size(group)
    layer = RowParallelLinear(
        local_weight.shape[1] * tp,
        local_weight.shape[0],
        config=megatron_config(local_weight.dtype),
        init_method=nn.init.zeros_,
        bias=bias is not None,
        input_is_parallel=True,
        skip_bias_add=False,
        tp_group=group,
    )
    return _load_shard(layer, local_weight, bias, split_dim=1, group=group)


def _load_shard(
    layer: _Linear, weight: Tensor, bias: Tensor | None, split_dim: int, group: ProcessGroup | None
) -> _Linear:
    """Copy this rank's weight shard (and bias) into a freshly built megatron linear and tag the split."""
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    mark_tp_split(layer.weight, dim=split_dim, group=group)
    return layer.to(weight.device)


def enter_tp_region(x: Tensor, group: ProcessGroup | None, sequence_parallel: bool) -> Tensor:
    """Input of the column-parallel matmuls: the full sequence on every tp rank, with the right backward."""
    if sequence_parallel:
        return gather_along_dim(x, SEQ_DIM, group)
    return copy_to_group(x, group)


def _row_output(row: RowParallelLinear, x: Tensor, sequence_parallel: bool) -> Tensor:
    if not sequence_parallel:
        return row(x)[0]  # megatron's own all-reduce path works on gloo
    out = reduce_scatter_along(F.linear(x, row.weight), SEQ_DIM, row.tp_group)
    if row.bias is not None:
        out = out + copy_to_group(row.bias, row.tp_group)
    return out


def exit_tp_region(partial: Tensor, group: ProcessGroup | None, sequence_parallel: bool) -> Tensor:
    """Sum of the per-rank partial results: all-reduced, or reduce-scattered along the sequence with Megatron-SP."""
    if sequence_parallel:
        return reduce_scatter_along(partial, SEQ_DIM, group)
    return reduce_from_group(partial, group)


# --------------------------------------------------------------------------------------------------------- norms
class SequenceParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` applied to a sequence shard; its weight and bias gradients are summed over ``group``."""

    def __init__(self, norm: nn.LayerNorm, group: ProcessGroup) -> None:
        super().__init__(norm.normalized_shape, norm.eps, norm.elementwise_affine, norm.bias is not None)
        _copy_params_from(self, norm)
        self.group = group
        for p in self.parameters():
            mark_sequence_parallel(p)

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else copy_to_group(self.weight, self.group)
        bias = None if self.bias is None else copy_to_group(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class SequenceParallelRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` applied to a sequence shard; its weight gradient is summed over ``group``."""

    def __init__(self, norm: nn.RMSNorm, group: ProcessGroup) -> None:
        super().__init__(norm.normalized_shape, norm.eps, norm.elementwise_affine)
        _copy_params_from(self, norm)
        self.group = group
        for p in self.parameters():
            mark_sequence_parallel(p)

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else copy_to_group(self.weight, self.group)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class _GradSummedModule(nn.Module):
    """Any module whose parameters are used on a sequence shard: runs it with gradient-summed parameters."""

    def __init__(self, module: nn.Module, group: ProcessGroup) -> None:
        super().__init__()
        self.module = module
        self.group = group
        for p in module.parameters():
            mark_sequence_parallel(p)

    def forward(self, *args: Tensor) -> Tensor:
        params = {name: copy_to_group(p, self.group) for name, p in self.module.named_parameters()}
        return torch.func.functional_call(self.module, params, args)


def _copy_params_from(new: nn.Module, old: nn.Module) -> None:
    """Same values, dtype and device as ``old`` (a freshly built norm is fp32 on CPU)."""
    like = next(old.parameters(), None)
    if like is not None:
        new.to(device=like.device, dtype=like.dtype)
    new.load_state_dict(old.state_dict())


def sequence_parallel_norm(norm: nn.Module, group: ProcessGroup | None) -> nn.Module:
    """Megatron-SP form of a norm (a copy; ``norm`` is left alone). LayerNorm/RMSNorm keep their parameter names;
    other norm classes are wrapped (their parameters then live under ``module.``)."""
    if group is None or group_size(group) == 1:
        return copy.deepcopy(norm)
    if type(norm) is nn.LayerNorm:
        return SequenceParallelLayerNorm(norm, group)
    if type(norm) is nn.RMSNorm:
        return SequenceParallelRMSNorm(norm, group)
    return _GradSummedModule(copy.deepcopy(norm), group)


# ----------------------------------------------------------------------------------------------------- attention
class TensorParallelAttention(nn.Module):
    """Megatron tensor-parallel self-attention (optionally Megatron-SP), made from full single-process weights.

    q/k/v weights are ``[heads*d, hidden]`` / ``[kv_heads*d, hidden]`` (``nn.Linear`` layout), ``o_weight`` is
    ``[hidden, heads*d]``. This rank keeps query heads ``[r*heads/tp, (r+1)*heads/tp)`` in one fused
    column-parallel ``qkv`` (its local rows are ``[q_r; k_r; v_r]``) and the matching input columns of the
    row-parallel ``o_proj``. ``rotary`` (if any) is applied to the full sequence of the local heads. ``causal=False``
    drops the causal mask (bidirectional encoders such as BERT and ViT).
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
    ) -> None:
        super().__init__()
        if len({b is None for b in (q_bias, k_bias, v_bias)}) > 1:
            raise ValueError("q_bias, k_bias and v_bias must be given together or not at all")
        tp, rank = group_size(group), group_rank(group)
        if heads % tp:
            raise ValueError(f"tp={tp} does not divide the {heads} attention heads")
        if heads % kv_heads:
            raise ValueError(f"{heads} heads are not a multiple of {kv_heads} key/value heads")
        self.group, self.sequence_parallel, self.rotary = group, sequence_parallel, rotary
        self.causal = causal
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
        elif tp % kv_heads == 0:
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
                [torch.arange(self.kv_head * d, (self.kv_head + 1) * d),
                 torch.arange((kv_heads + self.kv_head) * d, (kv_heads + self.kv_head + 1) * d)]
            )
        else:
            raise ValueError(f"tp={tp} and kv_heads={kv_heads}: one must divide the other")
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
            kv_w = copy_to_group(self.kv_weight, self.group)[rows]
            kv_b = None if self.kv_bias is None else copy_to_group(self.kv_bias, self.group)[rows]
            q = qkv
            k, v = F.linear(x, kv_w, kv_b).split([d, d], dim=-1)
        q, k, v = q.view(b, s, hq, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d)
        if self.rotary is not None:
            q, k = self.rotary(q, k)
        out = attention(q, k, v, causal=self.causal).reshape(b, s, hq * d)
        return _row_output(self.o_proj, out, self.sequence_parallel)


# ----------------------------------------------------------------------------------------------------------- MLP
class TensorParallelMLP(nn.Module):
    """Megatron tensor-parallel MLP: ``down(activation(*[up_i(x)]))`` with all ``up_i`` fused in one
    column-parallel layer (local rows ``[up_0 shard; up_1 shard; ...]``) and ``down`` row-parallel.

    GELU MLP: ``up_weights=[fc_in]``, ``activation=F.gelu``. SwiGLU: ``up_weights=[gate, up]``,
    ``activation=lambda g, u: F.silu(g) * u``.
    """

    def __init__(
        self,
        up_weights: Sequence[Tensor],
        up_biases: Sequence[Tensor | None],
        down_weight: Tensor,
        down_bias: Tensor | None,
        activation: Callable[..., Tensor],
        *,
        group: ProcessGroup,
        sequence_parallel: bool = False,
        names: tuple[Sequence[str], str] | None = None,
    ) -> None:
        super().__init__()
        # single-process names of the projections, for gather_full
        self.names = names or ([f"up.{i}" for i in range(len(up_weights))], "down")
        tp, rank = group_size(group), group_rank(group)
        self.group, self.sequence_parallel, self.activation = group, sequence_parallel, activation
        rows = [shard(w, 0, rank, tp) for w in up_weights]
        self.local_sizes = [r.shape[0] for r in rows]
        has_bias = up_biases[0] is not None
        bias = torch.cat([shard(b, 0, rank, tp) for b in up_biases if b is not None]) if has_bias else None
        self.up = column_parallel_linear(torch.cat(rows).detach(), bias, up_weights[0].shape[1], group)
        self.down = row_parallel_linear(shard(down_weight, 1, rank, tp).detach(), down_bias, group)

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        """Full single-process tensors (named by ``names``) assembled over the tp group, or their gradients."""
        up_names, down_name = self.names
        full: dict[str, Tensor] = {}
        weights = param_or_grad(self.up.weight, grads).split(self.local_sizes)
        biases = None if self.up.bias is None else param_or_grad(self.up.bias, grads).split(self.local_sizes)
        for i, name in enumerate(up_names):
            full[f"{name}.weight"] = all_gather_along_dim(weights[i], 0, self.group)
            if biases is not None:
                full[f"{name}.bias"] = all_gather_along_dim(biases[i], 0, self.group)
        full[f"{down_name}.weight"] = all_gather_along_dim(param_or_grad(self.down.weight, grads), 1, self.group)
        if self.down.bias is not None:
            full[f"{down_name}.bias"] = param_or_grad(self.down.bias, grads)
        return full

    def forward(self, x: Tensor) -> Tensor:
        x = enter_tp_region(x, self.group, self.sequence_parallel)
        parts = self.up(x)[0].split(self.local_sizes, dim=-1)
        return _row_output(self.down, self.activation(*parts), self.sequence_parallel)


@overload
def param_or_grad(param: Tensor, grads: bool) -> Tensor: ...


@overload
def param_or_grad(param: None, grads: bool) -> None: ...


@overload
def param_or_grad(param: Tensor | None, grads: bool) -> Tensor | None: ...


def param_or_grad(param: Tensor | None, grads: bool) -> Tensor | None:
    """A parameter's value, or its gradient (zeros when it has none yet)."""
    if param is None:
        return None
    if not grads:
        return param.detach()
    return torch.zeros_like(param) if param.grad is None else param.grad.detach()


@runtime_checkable
class _GathersFull(Protocol):
    """A parallel form that assembles its own single-process tensors (tp blocks, vocab embedding and head)."""

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]: ...


def gather_full_state(module: nn.Module, grads: bool = False, prefix: str = "") -> dict[str, Tensor]:
    """The single-process state (or gradients) of a parallel form, assembled over its tensor-parallel groups.

    Submodules with a ``gather_full(grads)`` method (the tp blocks, vocab-parallel embedding and head) assemble
    their shards; every other parameter is taken as held. Collective over the tp groups involved (call it on every
    rank). Gradients of parameters replicated over a Ulysses / vocab-sp / data-parallel group are returned as this
    rank holds them: summing those over the sharding group is the runtime's data-parallel reduction.
    """
    if isinstance(module, _GathersFull):  # a hasattr check on ``gather_full``
        return {prefix + name: t for name, t in module.gather_full(grads).items()}
    if isinstance(module, _GradSummedModule):
        return gather_full_state(module.module, grads, prefix)
    full: dict[str, Tensor] = {}
    for name, param in module.named_parameters(recurse=False):
        full[prefix + name] = param_or_grad(param, grads)
    for name, child in module.named_children():
        full.update(gather_full_state(child, grads, f"{prefix}{name}."))
    return full
