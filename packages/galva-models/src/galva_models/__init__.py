"""galva-models: Hugging Face models parallelized in place from their tables, datasets and the ``galva-train`` /
``galva-data`` commands.

- :mod:`galva_models.tables`: every causal-LM family whose config carries transformers' tensor-parallel and
  pipeline tables (llama, mistral, qwen2/3, gemma 1-3, phi, olmo, granite, ...), and Galva's table entries for
  gpt2, bert, t5, vit and swin (T5's and Swin's with a small hook each), cut where they stand and parallelized in
  place; ``adapter_for``, ``build_layered`` and ``family_names`` (re-exported here) say which family a config is
  and build it.
- :mod:`galva_models.data`: random data (a function of seed and step only), Megatron indexed datasets, and the
  global-batch contract with galva-hp's runtime.
- :mod:`galva_models.attention`: attention backend selection (SDPA default, flash-attn optional).
- :mod:`galva_models.cli`: ``galva-train`` (config parsing and validation in ``cli.config``) and ``galva-data``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "adapter_for": "galva_models.tables.registry",
    "build_layered": "galva_models.tables.registry",
    "family_names": "galva_models.tables.registry",
    "FamilyAdapter": "galva_models.tables.family",
    "LayerSpec": "galva_models.tables.family",
    "Task": "galva_models.tables.family",
    "parameter_name_map": "galva_models.tables.family",
}
"""Public names, imported on first use (``import galva_models`` stays light: no torch, no transformers)."""

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'galva_models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
