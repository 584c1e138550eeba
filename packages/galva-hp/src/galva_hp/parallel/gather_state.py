"""Assembling a parallel form's single-process state (or gradients) over its tensor-parallel groups."""

from __future__ import annotations

from typing import Protocol, overload, runtime_checkable

import torch
from torch import Tensor, nn

from galva_hp.parallel.sp_norms import GradSummedModule

__all__ = ["gather_full_state", "param_or_grad"]


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
    if isinstance(module, GradSummedModule):
        return gather_full_state(module.module, grads, prefix)
    full: dict[str, Tensor] = {}
    for name, param in module.named_parameters(recurse=False):
        full[prefix + name] = param_or_grad(param, grads)
    for name, child in module.named_children():
        full.update(gather_full_state(child, grads, f"{prefix}{name}."))
    return full
