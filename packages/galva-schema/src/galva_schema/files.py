"""The one atomic file writer every Galva distribution uses.

A file is written to a temporary name in the target directory and renamed over the target only once complete, so
a reader never sees a half-written file and a failed write leaves an existing file untouched. The temporary file is
created with mode ``0o666`` filtered by the process umask (what ``open()`` would give), without changing the umask.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

__all__ = ["output_problem", "write_bytes_atomic", "write_json_atomic", "write_text_atomic"]

_PROBE_BYTES = 64 * 1024


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        # O_EXCL: never follow or reuse another writer's file; mode 0o666 & ~umask like open() gives
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException as err:
        # inside the try from the open on: a signal's exception raised just after the open returned (before a
        # statement that would mark the file created) left it behind. Only the open raises FileExistsError, and then
        # the file is another writer's
        if not isinstance(err, FileExistsError):
            tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as indented JSON to ``path`` atomically.

    The JSON is encoded before anything touches the disk, so a value that is not JSON (NaN included) raises with no
    file created and an existing ``path`` left untouched.
    """
    return write_text_atomic(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def output_problem(path: str | os.PathLike[str], *, directory: bool = False) -> str | None:
    """Why ``path`` cannot be written (checked before a run starts, so that a run does not fail at its end), or None.

    A file output must not be a directory or a special file; a ``directory`` output must not be a file. The nearest
    existing directory must take a new file of 64 KiB (written, synced and removed again): this catches read-only
    and pseudo file systems (``/proc``) and a full disk. The message is a fragment (``is a directory``, ``cannot
    write in /proc: No such file or directory``) for the caller to prefix with the flag and the path.
    """
    p = Path(path)
    if directory:
        if p.exists() and not p.is_dir():
            return "is not a directory"
        where = p
    else:
        if p.is_dir():
            return "is a directory"
        if p.exists() and not p.is_file():
            return "is not a regular file"
        where = p.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        return f"{where} is not a directory"
    tmp = where / f".galva-write-probe.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * _PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        return f"cannot write in {where}: {err.strerror or err}"
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return None
