"""Norms (and any module) whose replicated parameters are applied to a sequence shard under Megatron-SP.

Their parameters pass through ``differentiable_copy_to_group`` inside ``forward``, so their gradient is summed over
the tp group: by autograd in every backward when a block is used on its own, or once per iteration by the runtime
(:func:`galva_hp.parallel.mappings.defer_param_grad_sums`). They are tagged ``param.galva_sequence_parallel = True``
for information only (do **not** reduce them again over tp).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.parallel.mappings import (
    differentiable_copy_to_group,
    group_size,
)
from galva_hp.parallel.tp_regions import mark_sequence_parallel

__all__ = ["GradSummedModule", "SequenceParallelLayerNorm", "SequenceParallelRMSNorm", "sequence_parallel_norm"]


class SequenceParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` applied to a sequence shard; its weight and bias gradients are summed over ``group``."""

    def __init__(self, norm: nn.LayerNorm, group: ProcessGroup) -> None:
        super().__init__(norm.normalized_shape, norm.eps, norm.elementwise_affine, norm.bias is not None)
        _adopt(self, norm)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else differentiable_copy_to_group(self.weight, self.group)
        bias = None if self.bias is None else differentiable_copy_to_group(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class SequenceParallelRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` applied to a sequence shard; its weight gradient is summed over ``group``."""

    def __init__(self, norm: nn.RMSNorm, group: ProcessGroup) -> None:
        super().__init__(norm.normalized_shape, norm.eps, norm.elementwise_affine)
        _adopt(self, norm)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else differentiable_copy_to_group(self.weight, self.group)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class GradSummedModule(nn.Module):
    """Any module whose parameters are used on a sequence shard: runs it with gradient-summed parameters."""

    def __init__(self, module: nn.Module, group: ProcessGroup) -> None:
        super().__init__()
        self.module = module
        self.group = group
        for p in module.parameters():
            mark_sequence_parallel(p)

    def forward(self, *args: Tensor) -> Tensor:
        params = {name: differentiable_copy_to_group(p, self.group) for name, p in self.module.named_parameters()}
        return torch.func.functional_call(self.module, params, args)


def _adopt(new: nn.Module, old: nn.Module) -> None:
    """Give ``new`` the values, dtype and device of ``old`` (a new norm is fp32 on CPU); tag its parameters."""
    like = next(old.parameters(), None)
    if like is not None:
        new.to(device=like.device, dtype=like.dtype)
    new.load_state_dict(old.state_dict())
    for p in new.parameters():
        mark_sequence_parallel(p)


def sequence_parallel_norm(norm: nn.Module, group: ProcessGroup | None) -> nn.Module:
    """Megatron-SP form of a norm (a copy; ``norm`` is left alone). LayerNorm/RMSNorm keep their parameter names;
    other norm classes are wrapped (their parameters then live under ``module.``)."""
    if group is None or group_size(group) == 1:
        return copy.deepcopy(norm)
    if type(norm) is nn.LayerNorm:
        return SequenceParallelLayerNorm(norm, group)
    if type(norm) is nn.RMSNorm:
        return SequenceParallelRMSNorm(norm, group)
    return GradSummedModule(copy.deepcopy(norm), group)
