"""megatron-core's modules, imported without torch's compiler.

``megatron.core`` imports its fused kernels (bias-GeLU, SwiGLU, the fused cross entropy, ...) from its package
``__init__``, whatever module is asked for, and wraps each in ``torch.compile`` at import (``megatron.core.jit``'s
``jit_fuser``). The first ``torch.compile`` call imports torch's inductor: 3 of the 3.5-3.8 s megatron-core's import
took on this project's CPU machine, paid by every rank that builds a tensor-parallel layer or reads an indexed
dataset (a forked rank does not inherit a module its parent never imported). Galva calls none of those kernels: its
tensor-parallel layers are megatron's linears and its data path is megatron's indexed dataset. So while
megatron-core imports, ``torch.compile`` is the identity, and those kernels stay plain Python functions in this
process; a process that imported megatron-core before Galva keeps what it has.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

__all__ = ["import_megatron"]


def _uncompiled(model: Callable[..., Any] | None = None, **_options: Any) -> Any:
    """``torch.compile``'s two call forms (``compile(fn)`` and ``compile(**options)(fn)``), returning ``fn``."""
    return model if model is not None else (lambda fn: fn)


def import_megatron(name: str) -> ModuleType:
    """``importlib.import_module(name)`` for a module of megatron-core (``"megatron.core.tensor_parallel"``), its
    package imported with ``torch.compile`` as the identity the first time; megatron-core's note that it falls back
    from Transformer Engine / Apex kernels to its own (once per rank, and changing nothing Galva uses) is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        if "megatron.core" in sys.modules:
            return importlib.import_module(name)
        compile_ = torch.compile
        torch.compile = _uncompiled
        try:
            return importlib.import_module(name)
        finally:
            torch.compile = compile_
