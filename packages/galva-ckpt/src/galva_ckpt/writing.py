"""Writing safetensors files one tensor at a time, and whole directories under a temporary name.

:func:`write_safetensors` writes the header from the tensors' shapes and dtypes, then each tensor's bytes as it
arrives, hashing them on the way: a file of any size needs only one tensor in memory, and its checksum costs no
second read. The files are plain safetensors (header length, JSON header padded to 8 bytes, data), read back by
the ``safetensors`` library.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from galva_ckpt.errors import CheckpointError
from galva_ckpt.format import SAFETENSORS_CODE, dtype_name
from galva_schema.checkpoint import FileInfo, TensorInfo

__all__ = ["atomic_directory", "copy_file", "tensor_infos", "write_bytes", "write_safetensors", "write_tensors"]

_CHUNK = 1 << 23


def tensor_infos(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorInfo]:
    """Shape and dtype of each tensor, in the mapping's order."""
    return {name: TensorInfo(shape=tuple(t.shape), dtype=dtype_name(t.dtype)) for name, t in tensors.items()}


def write_tensors(
    path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> FileInfo:
    """Write a mapping of tensors to one safetensors file; returns its size and sha256."""
    return write_safetensors(path, tensor_infos(tensors), tensors.values(), metadata)


def write_safetensors(
    path: str | os.PathLike[str],
    infos: Mapping[str, TensorInfo],
    tensors: Iterable[torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    on_tensor: Callable[[int], None] | None = None,
) -> FileInfo:
    """Write a safetensors file whose tensors (``infos``, in order) arrive one by one from ``tensors``.

    Each arriving tensor must have the announced shape and dtype. ``on_tensor(nbytes)`` is called after each one
    (progress bars). Returns the file's size and sha256.
    """
    path = Path(path)
    header, sizes = _header(infos, metadata)
    digest = hashlib.sha256()
    written = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        for chunk in (struct.pack("<Q", len(header)), header):
            out.write(chunk)
            digest.update(chunk)
            written += len(chunk)
        arrived = iter(tensors)
        for (name, info), nbytes in zip(infos.items(), sizes):
            tensor = next(arrived, None)
            if tensor is None:
                raise CheckpointError(f"{path}: tensor {name}: no data given (internal error)")
            data = _bytes_of(tensor, name, info, path)
            out.write(data)
            digest.update(data)
            written += nbytes
            if on_tensor is not None:
                on_tensor(nbytes)
    return FileInfo(size=written, sha256=digest.hexdigest())


def _header(infos: Mapping[str, TensorInfo], metadata: Mapping[str, str] | None) -> tuple[bytes, list[int]]:
    """The padded JSON header and each tensor's byte count."""
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    sizes: list[int] = []
    offset = 0
    for name, info in infos.items():
        dtype = getattr(torch, info.dtype)
        nbytes = dtype.itemsize * _numel(info.shape)
        entries[name] = {
            "dtype": SAFETENSORS_CODE[dtype],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        sizes.append(nbytes)
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8), sizes  # 8-byte alignment, as the safetensors library pads


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _bytes_of(tensor: torch.Tensor, name: str, info: TensorInfo, path: Path) -> memoryview:
    if tuple(tensor.shape) != info.shape or dtype_name(tensor.dtype) != info.dtype:
        got = f"{tuple(tensor.shape)} {dtype_name(tensor.dtype)}"
        raise CheckpointError(f"{path}: tensor {name} is {got}, expected {info.shape} {info.dtype}")
    # little-endian raw bytes, as safetensors stores them (x86 and ARM hosts are little-endian)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def copy_file(source: Path, target: Path) -> FileInfo:
    """Copy a file in chunks, hashing what is written; returns the copy's size and sha256."""
    digest = hashlib.sha256()
    size = 0
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(_CHUNK):
            dst.write(chunk)
            digest.update(chunk)
            size += len(chunk)
    return FileInfo(size=size, sha256=digest.hexdigest())


def write_bytes(target: Path, data: bytes) -> FileInfo:
    """Write ``data`` to ``target``; returns its size and sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return FileInfo(size=len(data), sha256=hashlib.sha256(data).hexdigest())


@contextmanager
def atomic_directory(target: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a fresh ``<target>.tmp-<random>`` directory that becomes ``target`` only if the block succeeds.

    A non-empty ``target`` is refused unless ``force``; then it is replaced only after the new one is complete
    (moved aside, the new directory renamed in, the old one deleted). On any error the temporary directory is
    removed and ``target`` is untouched.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise CheckpointError(f"{target}: directory is not empty; pass --force to replace it")
    token = secrets.token_hex(4)
    tmp = target.parent / f"{target.name}.tmp-{token}"
    try:
        tmp.mkdir(parents=True)
    except OSError as err:  # the error names the target, not the temporary directory nobody asked for
        raise OSError(err.errno, err.strerror, str(target)) from None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = target.parent / f"{target.name}.old-{token}"
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
