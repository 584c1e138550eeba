"""Saving one layerwise checkpoint from many ranks at once, each writing only the pieces it owns.

The layerwise files hold full tensors, so their headers (and every tensor's byte range) follow from the model's
shapes and dtypes alone. Rank 0 creates each file at its final size with its header; then every rank writes its
pieces straight into their places (``os.pwrite``: one run per contiguous stretch of a row-major box), and nobody
gathers a tensor. A piece held by several ranks (data-parallel replicas, tp-replicated norms, tied copies) is
written by the lowest of them. Checksums are computed file by file on all ranks in turn, then rank 0 writes
``rng.safetensors`` and the manifest, last, and renames the temporary directory: a save that dies half-way leaves
``<name>.tmp-<token>`` without a manifest, which :func:`galva_ckpt.saves.latest_checkpoint` ignores with a warning.
A save that fails with an ``OSError`` on any rank (a full disk) is abandoned by every rank together: the temporary
directory is removed and every rank raises the same one-line :class:`CheckpointError`; earlier saves are untouched.

Every rank must call :func:`save_sharded` with its own pieces (it is collective over the default group).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from galva_ckpt.checkpoint import CheckpointWriter
from galva_ckpt.errors import CheckpointError
from galva_ckpt.format import module_file, optimizer_file
from galva_ckpt.reading import sha256_file
from galva_ckpt.writing import _header
from galva_schema.checkpoint import FileInfo, ModuleEntry, TensorInfo

__all__ = ["Piece", "save_sharded"]

@dataclass(frozen=True)
class Piece:
    """A block of one full tensor: ``tensor`` of ``file`` (relative path), at ``offsets`` with ``sizes``."""

    file: str
    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class _Layout:
    """Where each tensor's bytes lie in a file: data start, and per tensor (byte offset, shape, item size)."""

    header: bytes
    tensors: dict[str, tuple[int, tuple[int, ...], int]]
    size: int


def _layout(infos: Mapping[str, TensorInfo], metadata: Mapping[str, str]) -> _Layout:
    header, sizes = _header(infos, metadata)
    start = 8 + len(header)
    tensors: dict[str, tuple[int, tuple[int, ...], int]] = {}
    offset = start
    for (name, info), nbytes in zip(infos.items(), sizes):
        tensors[name] = (offset, tuple(info.shape), getattr(torch, info.dtype).itemsize)
        offset += nbytes
    return _Layout(header, tensors, offset)


def _runs(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[list[int], int]:
    """Element offsets of the contiguous runs of a box in a row-major tensor, and the run length."""
    dims = len(shape)
    if dims == 0:
        return [0], 1
    last = dims - 1  # the last axis the box does not cover whole; everything after it is contiguous
    while last > 0 and offsets[last] == 0 and sizes[last] == shape[last]:
        last -= 1
    inner = 1
    for axis in range(last + 1, dims):
        inner *= shape[axis]
    length = sizes[last] * inner
    strides = [1] * dims
    for axis in range(dims - 2, -1, -1):
        strides[axis] = strides[axis + 1] * shape[axis + 1]
    starts = torch.zeros((), dtype=torch.long) + offsets[last] * strides[last]
    for axis in range(last):
        starts = starts.unsqueeze(-1) + (torch.arange(sizes[axis]) + offsets[axis]) * strides[axis]
    return starts.reshape(-1).tolist(), length


def _write_piece(path: Path, layout: _Layout, piece: Piece, data: torch.Tensor) -> int:
    offset, shape, itemsize = layout.tensors[piece.tensor]
    if any(o < 0 or o + s > n for o, s, n in zip(piece.offsets, piece.sizes, shape)) or len(shape) != len(piece.sizes):
        raise CheckpointError(f"{path}: tensor {piece.tensor}: block {piece.offsets}+{piece.sizes} outside {shape}")
    raw = data.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    starts, length = _runs(shape, piece.offsets, piece.sizes)
    nbytes = length * itemsize
    fd = os.open(path, os.O_WRONLY)
    try:
        for k, start in enumerate(starts):
            os.pwrite(fd, memoryview(raw[k * nbytes : (k + 1) * nbytes]), offset + start * itemsize)  # type: ignore[arg-type]
    finally:
        os.close(fd)
    return len(starts) * nbytes


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def save_sharded(
    target: str | os.PathLike[str],
    model_infos: Mapping[str, Mapping[str, TensorInfo]],
    optimizer_infos: Mapping[str, Mapping[str, TensorInfo]] | None,
    pieces: Sequence[tuple[Piece, torch.Tensor]],
    rng: Mapping[str, torch.Tensor],
    finish: Mapping[str, Any],
    hf_files: Mapping[str, bytes] | None = None,
) -> dict[str, float]:
    """Write the checkpoint ``target`` from every rank (collective). Returns this rank's ``bytes`` written (tensor
    data, plus headers, rng and manifest on rank 0) and ``seconds`` spent writing its pieces.

    ``model_infos`` / ``optimizer_infos``: module -> tensor name -> full shape and dtype, the same on every rank.
    ``pieces``: this rank's blocks (files named by :func:`~galva_ckpt.format.module_file` /
    :func:`~galva_ckpt.format.optimizer_file`); together the ranks' pieces must cover every tensor exactly
    (identical blocks on several ranks are written once). ``rng``: this rank's RNG states (saved as
    ``rank<r>/<name>``). ``finish``: :meth:`CheckpointWriter.finish`'s keyword arguments. ``hf_files``: Hugging Face
    side files (tokenizer, generation config) by name, kept under ``hf/`` (rank 0's are written; g2h writes them back).
    """
    target = Path(target)
    rank, world = dist.get_rank(), dist.get_world_size()
    layouts: dict[str, _Layout] = {}
    entries: dict[str, tuple[str, bool, Mapping[str, TensorInfo]]] = {}
    for kind, infos in (("model", model_infos), ("optimizer", optimizer_infos or {})):
        for module, tensors in infos.items():
            relative = module_file(module) if kind == "model" else optimizer_file(module)
            layouts[relative] = _layout(tensors, {"format": "pt", "galva_module": module})
            entries[relative] = (module, kind == "optimizer", tensors)

    # which rank writes which piece: the lowest holder; and the pieces must tile every tensor
    keys = [piece for piece, _ in pieces]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, keys)
    owner: dict[Piece, int] = {}
    for r, held in enumerate(everyone):
        for piece in held:
            owner.setdefault(piece, r)
    _check_tiling(target, owner, layouts)

    name = [f"{target.name}.tmp-{secrets.token_hex(4)}"]
    dist.broadcast_object_list(name, src=0)
    tmp = target.parent / name[0]
    failure = None
    if rank == 0:
        try:
            for relative, layout in layouts.items():
                path = tmp / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as out:
                    out.write(len(layout.header).to_bytes(8, "little"))
                    out.write(layout.header)
                    out.truncate(layout.size)
        except OSError as err:
            failure = err
    _agree(failure, target, tmp)  # in place of a barrier: every rank learns of a failure on any rank
    start = time.perf_counter()
    written = 0
    try:
        for piece, data in pieces:
            if owner[piece] == rank:
                written += _write_piece(tmp / piece.file, layouts[piece.file], piece, data)
    except OSError as err:
        failure = err
    write_s = time.perf_counter() - start
    _agree(failure, target, tmp)

    files = list(layouts)  # module order (the manifest lists modules in the model's order)
    mine = {f: sha256_file(tmp / f) for i, f in enumerate(files) if i % world == rank}
    hashed: list[Any] = [None] * world
    dist.all_gather_object(hashed, mine)
    states: list[Any] = [None] * world
    dist.all_gather_object(states, {k: v.clone() for k, v in rng.items()})
    if rank == 0:
        writer = CheckpointWriter(tmp)
        infos_of: dict[str, FileInfo] = {f: i for part in hashed for f, i in part.items()}
        for relative in files:
            module, is_optimizer, tensors = entries[relative]
            writer.files[relative] = infos_of[relative]
            entry = ModuleEntry(name=module, file=relative, tensors=dict(tensors))
            (writer.optimizer_modules if is_optimizer else writer.modules).append(entry)
        try:
            writer.write_rng({f"rank{r}/{k}": v for r, part in enumerate(states) for k, v in part.items()})
            for file_name, content in (hf_files or {}).items():
                writer.write_hf_file(file_name, content)
            writer.finish(**finish)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        except OSError as err:
            failure = err
    _agree(failure, target, tmp)
    if rank == 0:
        written += sum(8 + len(layout.header) for layout in layouts.values())
        written += sum((target / f).stat().st_size for f in ("manifest.json", "rng.safetensors"))
        written += sum(len(content) for content in (hf_files or {}).values())
    return {"bytes": float(written), "seconds": write_s}


def _agree(failure: OSError | None, target: Path, tmp: Path) -> None:
    """A barrier that also shares failures: if any rank's ``OSError`` is in, rank 0 removes the temporary directory
    and every rank raises the same one-line error (the first failing rank's reason)."""
    reasons: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, None if failure is None else (failure.strerror or str(failure)))
    reason = next((r for r in reasons if r is not None), None)
    if reason is None:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()  # the temporary directory is gone before any rank reports
    raise CheckpointError(f"cannot save checkpoint to {target}: {reason}")


def _check_tiling(target: Path, owner: Mapping[Piece, int], layouts: Mapping[str, _Layout]) -> None:
    """Every tensor covered exactly once by distinct blocks (same answer on every rank: no rank waits alone)."""
    volume: dict[tuple[str, str], int] = {}
    for piece in owner:
        if piece.file not in layouts or piece.tensor not in layouts[piece.file].tensors:
            raise CheckpointError(f"{target / piece.file}: tensor {piece.tensor} is not part of the model")
        key = (piece.file, piece.tensor)
        volume[key] = volume.get(key, 0) + _numel(piece.sizes)
    for relative, layout in layouts.items():
        for tensor, (_, shape, _) in layout.tensors.items():
            got = volume.get((relative, tensor), 0)
            if got != _numel(shape):
                what = "no rank holds it" if got == 0 else f"the ranks hold {got} of its {_numel(shape)} elements"
                raise CheckpointError(f"{target / relative}: tensor {tensor}: {what} (cannot save)")
