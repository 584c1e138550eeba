"""Megatron tensor-parallel regions and linears: megatron-core layers with an explicit ``tp_group``, no CUDA.

A tensor-parallel block turns a replicated (or, with Megatron-SP, sequence-sharded) input into a result of the same
layout:

- plain tp: ``differentiable_copy_to_group`` on entry (backward all-reduce of the partial input gradient), all-reduce
  on exit;
- Megatron-SP: all-gather along the sequence on entry (backward reduce-scatter), reduce-scatter along the sequence
  on exit (backward all-gather).

megatron's ``sequence_parallel=True`` path allocates CUDA buffers, so megatron layers are always built with
``sequence_parallel=False`` and ``disable_grad_reduce=True`` and the region mappings of :mod:`.mappings` do the
communication; the matmuls are megatron's. Activations are ``[batch, seq, hidden]``.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from galva_hp.megatron_import import import_megatron
from galva_hp.parallel.mappings import (
    differentiable_all_gather,
    differentiable_copy_to_group,
    differentiable_reduce_from_group,
    differentiable_reduce_scatter,
    group_size,
)

__all__ = [
    "SEQ_DIM",
    "column_parallel_linear",
    "enter_tp_region",
    "exit_tp_region",
    "mark_sequence_parallel",
    "mark_tp_split",
    "megatron_config",
    "row_output",
    "row_parallel_linear",
    "shard",
]


SEQ_DIM = 1  # activations are [batch, seq, hidden]


@functools.cache
def _megatron() -> tuple[ModuleType, ModuleType]:
    """megatron-core's package and its ``tensor_parallel``, imported on first use (:mod:`galva_hp.megatron_import`):
    a rank whose plan holds no tp layer never pays their import."""
    return import_megatron("megatron.core"), import_megatron("megatron.core.tensor_parallel")


def megatron_config(dtype: torch.dtype = torch.float32) -> ModelParallelConfig:
    """The megatron-core config Galva builds its layers with (CPU-safe: no CUDA init, no fused kernels)."""
    core, _ = _megatron()
    config: ModelParallelConfig = core.ModelParallelConfig(
        use_cpu_initialization=True,
        perform_initialization=False,  # weights are copied from the single-process module
        sequence_parallel=False,  # Galva's own mappings do Megatron-SP (megatron's path needs CUDA buffers)
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
    )
    return config


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
        _megatron()[1].set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


_Linear = TypeVar("_Linear", "ColumnParallelLinear", "RowParallelLinear")


def column_parallel_linear(
    local_weight: Tensor, local_bias: Tensor | None, input_size: int, group: ProcessGroup | None
) -> ColumnParallelLinear:
    """A megatron ``ColumnParallelLinear`` holding ``local_weight`` (``[out/tp, in]``), with no communication of its
    own (the caller enters the tp region). ``group=None`` is a single rank (tp 1)."""
    tp = group_size(group)
    layer = _megatron()[1].ColumnParallelLinear(
        input_size,
        local_weight.shape[0] * tp,
        gather_output=False,
        disable_grad_reduce=True,
        **_megatron_options(local_weight, local_bias, group),
    )
    return _load_shard(layer, local_weight, local_bias, split_dim=0, group=group)


def row_parallel_linear(local_weight: Tensor, bias: Tensor | None, group: ProcessGroup) -> RowParallelLinear:
    """A megatron ``RowParallelLinear`` holding ``local_weight`` (``[out, in/tp]``) and the full ``bias``."""
    tp = group_size(group)
    layer = _megatron()[1].RowParallelLinear(
        local_weight.shape[1] * tp,
        local_weight.shape[0],
        input_is_parallel=True,
        **_megatron_options(local_weight, bias, group),
    )
    return _load_shard(layer, local_weight, bias, split_dim=1, group=group)


def _megatron_options(weight: Tensor, bias: Tensor | None, group: ProcessGroup | None) -> dict[str, Any]:
    """What both megatron linears take alike: the config at the weight's dtype, no initialisation of their own (the
    shard is loaded next), the bias added inside, and the tp group."""
    return {
        "config": megatron_config(weight.dtype),
        "init_method": nn.init.zeros_,
        "bias": bias is not None,
        "skip_bias_add": False,
        "tp_group": group,
    }


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
        return differentiable_all_gather(x, SEQ_DIM, group)
    return differentiable_copy_to_group(x, group)


def row_output(row: RowParallelLinear, x: Tensor, sequence_parallel: bool) -> Tensor:
    if not sequence_parallel:
        return row(x)[0]  # megatron's own all-reduce path works on gloo
    out = differentiable_reduce_scatter(F.linear(x, row.weight), SEQ_DIM, row.tp_group)
    if row.bias is not None:
        out = out + differentiable_copy_to_group(row.bias, row.tp_group)
    return out


def exit_tp_region(partial: Tensor, group: ProcessGroup | None, sequence_parallel: bool) -> Tensor:
    """Sum of the per-rank partial results: all-reduced, or reduce-scattered along the sequence with Megatron-SP."""
    if sequence_parallel:
        return differentiable_reduce_scatter(partial, SEQ_DIM, group)
    return differentiable_reduce_from_group(partial, group)
