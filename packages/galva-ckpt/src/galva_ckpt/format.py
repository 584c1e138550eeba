"""Names and tables of the layerwise format: file paths inside a checkpoint and dtype codes.

A checkpoint directory::

    manifest.json                       CheckpointManifest (galva_schema), written last
    model/<module>.safetensors          full tensors of one module under Hugging Face on-disk names
    optimizer/<module>.safetensors      '<state>/<name>' tensors (exp_avg, exp_avg_sq), when saved by training
    rng.safetensors                     uint8 RNG states, when saved by training
    hf/<file>                           Hugging Face side files (tokenizer, generation config), verbatim

Modules are ``embedding``, ``layers.<i>`` and ``head`` (galva-models' decomposition).
"""

from __future__ import annotations

import torch

__all__ = [
    "HF_DIR",
    "MANIFEST",
    "RNG_FILE",
    "SAFETENSORS_CODE",
    "TORCH_DTYPE",
    "dtype_name",
    "module_file",
    "optimizer_file",
]

MANIFEST = "manifest.json"
HF_DIR = "hf"
RNG_FILE = "rng.safetensors"


def module_file(module: str) -> str:
    """Relative path of a module's weights file."""
    return f"model/{module}.safetensors"


def optimizer_file(module: str) -> str:
    """Relative path of a module's optimizer-state file."""
    return f"optimizer/{module}.safetensors"


TORCH_DTYPE: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype code -> torch dtype."""

SAFETENSORS_CODE: dict[torch.dtype, str] = {dtype: code for code, dtype in TORCH_DTYPE.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's spelling of a dtype: ``torch.float32`` -> ``float32``."""
    return str(dtype).removeprefix("torch.")
