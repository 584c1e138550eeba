"""Attention backend selection: torch SDPA by default, flash-attn when installed and asked for.

The backend is chosen per run (``galva-train --attention-backend sdpa|flash``) and handed to transformers as the
model's ``attn_implementation``; the adapters reuse the Hugging Face attention modules, so both backends run the
same weights. flash-attn is an optional extra (``pip install galva-models[flash]``, CUDA only) and is imported
only when selected.
"""

from __future__ import annotations

import importlib.util

BACKENDS = {"sdpa": "sdpa", "flash": "flash_attention_2"}
"""Galva backend name -> transformers ``attn_implementation``."""


class AttentionBackendError(RuntimeError):
    """The selected attention backend cannot be used on this machine."""


def attn_implementation(backend: str = "sdpa") -> str:
    """The transformers ``attn_implementation`` for ``backend``, after checking that it can run here."""
    if backend not in BACKENDS:
        raise AttentionBackendError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "flash":
        if importlib.util.find_spec("flash_attn") is None:
            raise AttentionBackendError(
                "--attention-backend flash needs the flash-attn package (pip install 'galva-models[flash]', "
                "CUDA only); use --attention-backend sdpa"
            )
        import torch

        if not torch.cuda.is_available():
            raise AttentionBackendError("--attention-backend flash needs a CUDA device; use --attention-backend sdpa")
        importlib.import_module("flash_attn")  # surface a broken install here, not mid-training
    return BACKENDS[backend]
