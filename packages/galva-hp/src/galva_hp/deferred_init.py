"""Deferred (meta-device) initialisation: build the whole model without memory, materialise one module at a time.

A :class:`~galva_hp.model.LayeredModel` created under ``torch.device("meta")`` holds no storage. :func:`materialize`
gives one module real (CPU) storage and initialises it with the caller's ``init_fn``; the builder does this only for
the modules of its own stage, right before converting each to its tensor-parallel form and sharding it, so a rank
holds at most one full module at a time besides its own shards, never the full model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["InitFn", "is_meta", "materialize"]

InitFn = Callable[[str, nn.Module], None]
"""``init_fn(name, module)`` fills a freshly materialised module (``"embedding"``, ``"layers.3"``, ``"head"``)
in place. It must be deterministic per name, so every rank (and the single-process oracle) gets the same values."""


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(name: str, module: nn.Module, init_fn: InitFn | None, device: str | torch.device = "cpu") -> nn.Module:
    """Allocate ``module`` on ``device`` and initialise it with ``init_fn`` (no-op for a module already real)."""
    if not is_meta(module):
        return module
    if init_fn is None:
        raise ValueError(f"{name}: the model is on the meta device; pass BuildOptions(init_fn=...) to initialise it")
    module.to_empty(device=device)
    with torch.no_grad():
        init_fn(name, module)
    return module
