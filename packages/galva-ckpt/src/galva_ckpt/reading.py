"""Reading safetensors files lazily and checking them: headers, whole modules, slices, checksums.

Everything goes through ``safetensors.safe_open`` (no unpickling). A file handle is opened for one module and
closed after it: safetensors maps the file, and a handle kept open would keep every page it touched resident.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from galva_ckpt.errors import CheckpointError
from galva_ckpt.format import TORCH_DTYPE, dtype_name
from galva_schema.checkpoint import FileInfo, TensorInfo
from galva_schema.interrupt import raise_if_interrupted

__all__ = ["open_safetensors", "read_header", "read_slice", "read_tensors", "sha256_file", "verify_file"]

_CHUNK = 1 << 23


@contextmanager
def open_safetensors(path: str | os.PathLike[str]) -> Iterator[Any]:
    """``safe_open(path, "pt")`` whose failures (missing, not safetensors, damaged header) are CheckpointErrors."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({_first_line(err)})") from None
    with handle as opened:
        yield opened


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Name -> shape and dtype of every tensor in the file, without reading any data."""
    out: dict[str, TensorInfo] = {}
    with open_safetensors(path) as handle:
        names = handle.keys()
        for name in names:
            view = handle.get_slice(name)
            code = view.get_dtype()
            if code not in TORCH_DTYPE:
                raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {code}")
            out[name] = TensorInfo(shape=tuple(view.get_shape()), dtype=dtype_name(TORCH_DTYPE[code]))
    return out


def read_tensors(path: str | os.PathLike[str], names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The named tensors of one file (all by default), fully read."""
    return dict(iter_tensors(path, names))


def iter_tensors(
    path: str | os.PathLike[str], names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one at a time from an open file (closed when the iteration ends)."""
    with open_safetensors(path) as handle:
        available = set(handle.keys())
        for name in handle.keys() if names is None else names:
            if name not in available:
                raise CheckpointError(f"{path}: tensor {name} missing")
            try:
                tensor = handle.get_tensor(name)
            except (SafetensorError, OSError, ValueError) as err:
                raise_if_interrupted()  # Ctrl-C inside the read surfaces as the reader's own error
                raise CheckpointError(f"{path}: tensor {name}: cannot be read ({_first_line(err)})") from None
            yield name, tensor


def read_slice(path: str | os.PathLike[str], name: str, index: tuple[slice | int, ...]) -> torch.Tensor:
    """``tensor[index]`` read from the file without reading the rest of the tensor (e.g. one rank's tp shard)."""
    with open_safetensors(path) as handle:
        if name not in set(handle.keys()):
            raise CheckpointError(f"{path}: tensor {name} missing")
        return handle.get_slice(name)[index]


def sha256_file(path: str | os.PathLike[str]) -> FileInfo:
    """Size and sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileInfo(size=size, sha256=digest.hexdigest())


def verify_file(directory: Path, relative: str, expected: FileInfo | None) -> None:
    """Raise a CheckpointError naming the file unless it exists with the expected size and sha256."""
    path = directory / relative
    if expected is None:
        raise CheckpointError(f"{path}: no checksum in the manifest")
    if not path.is_file():
        raise CheckpointError(f"{path}: file missing")
    actual = sha256_file(path)
    if actual.size != expected.size:
        raise CheckpointError(f"{path}: size {actual.size} bytes, the manifest says {expected.size} (truncated?)")
    if actual.sha256 != expected.sha256:
        raise CheckpointError(
            f"{path}: checksum mismatch (sha256 {actual.sha256[:12]}..., the manifest says {expected.sha256[:12]}...)"
        )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
