"""galva-ckpt: layerwise, strategy-independent checkpoints for Galva, and Hugging Face conversion (h2g / g2h).

- :mod:`galva_ckpt.format`: the directory layout and dtype tables; the manifest is galva_schema's
  :class:`~galva_schema.CheckpointManifest`.
- :mod:`galva_ckpt.writing` / :mod:`galva_ckpt.reading`: streaming safetensors writer with inline sha256, lazy
  reads (one module, one slice), checksum checks, directories written under a temporary name.
- :mod:`galva_ckpt.checkpoint`: :class:`CheckpointWriter` and :class:`CheckpointReader`, the API training uses.
- :mod:`galva_ckpt.convert`: ``hf_to_galva`` and ``galva_to_hf``; :mod:`galva_ckpt.cli`: the ``galva-ckpt`` command.
"""

from __future__ import annotations

from typing import Any

from galva_ckpt.errors import CheckpointError

__version__ = "0.1.0"

_LAZY = {"CheckpointReader": "checkpoint", "CheckpointWriter": "checkpoint", "atomic_directory": "writing"}


def __getattr__(name: str) -> Any:
    """Import torch-backed parts on first use, so that ``galva-ckpt --help`` starts at once."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"galva_ckpt.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'galva_ckpt' has no attribute {name!r}")


__all__ = ["CheckpointError", "CheckpointReader", "CheckpointWriter", "__version__", "atomic_directory"]
