"""Hugging Face checkpoint directories: which file holds each tensor, side files, and the shard plan for output.

Input is ``model.safetensors`` or ``model.safetensors.index.json`` with its shards; output is the same layout
``save_pretrained`` writes (one file when it fits ``max_shard_size``, else ``model-0000i-of-0000n.safetensors``
plus the index). Pickled weights (``pytorch_model.bin``) are refused: reading them would run code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from galva_ckpt.errors import CheckpointError
from galva_ckpt.reading import read_header
from galva_schema.checkpoint import TensorInfo

__all__ = [
    "CONFIG",
    "INDEX",
    "SINGLE",
    "HFWeights",
    "parse_size",
    "plan_shards",
    "read_hf_weights",
    "read_side_files",
    "shard_name",
    "side_files",
]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


@dataclass
class HFWeights:
    """Where every tensor of a Hugging Face checkpoint lies, with its shape and dtype (headers only)."""

    directory: Path
    file_of: dict[str, Path] = field(default_factory=dict)
    info: dict[str, TensorInfo] = field(default_factory=dict)


def read_hf_weights(directory: Path) -> HFWeights:
    """Read the headers of a single-file or sharded safetensors checkpoint; no tensor data is read."""
    weights = HFWeights(directory)
    index, single = directory / INDEX, directory / SINGLE
    if index.is_file():
        for name, path in _index_entries(index).items():
            weights.file_of[name] = path
        for path in sorted(set(weights.file_of.values())):
            header = read_header(path)
            for name, info in header.items():
                if weights.file_of.get(name, path) != path:
                    raise CheckpointError(f"{path}: tensor {name}: the index puts it in {weights.file_of[name].name}")
                weights.file_of[name] = path
                weights.info[name] = info
        unread = sorted(set(weights.file_of) - set(weights.info))
        if unread:
            raise CheckpointError(f"{weights.file_of[unread[0]]}: tensor {unread[0]} missing (listed in {INDEX})")
    elif single.is_file():
        for name, info in read_header(single).items():
            weights.file_of[name] = single
            weights.info[name] = info
    elif any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise CheckpointError(f"{directory}: only safetensors weights are read (pickled .bin/.pt files run code)")
    else:
        raise CheckpointError(f"{directory}: no {SINGLE} or {INDEX}")
    return weights


def _index_entries(index: Path) -> dict[str, Path]:
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{index}: not a safetensors index (expected JSON with a 'weight_map' object)") from None
    out: dict[str, Path] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or "/" in file or "\\" in file:
            raise CheckpointError(f"{index}: tensor {name}: bad file name {file!r}")
        out[name] = index.parent / file
    return out


def side_files(directory: Path) -> list[Path]:
    """Files kept verbatim next to the weights: tokenizer, generation config, ... (not config.json, no weights)."""
    out = []
    for path in sorted(directory.iterdir()):
        skip = path.name in (CONFIG, INDEX) or path.name.startswith(".") or path.name.endswith(_WEIGHT_SUFFIXES)
        if path.is_file() and not skip:
            out.append(path)
    return out


def read_side_files(directory: Path) -> dict[str, bytes]:
    """The :func:`side_files` of ``directory`` by name, read (a training run keeps them for every save)."""
    return {path.name: path.read_bytes() for path in side_files(directory)}


def shard_name(index: int, count: int) -> str:
    """``model.safetensors`` for a single file, else ``model-00001-of-00003.safetensors`` (1-based)."""
    return SINGLE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Split tensors (in order) into shards of at most ``max_shard_size`` bytes (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"5GB"`` (decimal, as transformers reads it), ``"512MiB"`` or plain bytes -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB or a byte count)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"not a positive size: {text!r}")
    return size
