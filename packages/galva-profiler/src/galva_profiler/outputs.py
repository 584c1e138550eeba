"""Checks made before anything is measured, so that a bad output path fails in a second, not after the sweep."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from galva_profiler.errors import ProfileError
from galva_schema import output_problem


def check_writable_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` can be written: its directory exists and is writable, and it is not itself a directory."""
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ProfileError(f"{flag} {target}: is a directory; give a file name")
    if not parent.is_dir():
        raise ProfileError(f"{flag} {target}: directory {parent} does not exist")
    _probe(parent, f"{flag} {target}")
    return target


def _probe(directory: Path, what: str) -> None:
    """Write and remove a file in ``directory``: permission bits say nothing for root or on special file systems, and
    an empty file still fits on a full disk (:func:`galva_schema.output_problem` writes 64 KiB)."""
    problem = output_problem(directory, directory=True)
    if problem is not None:
        raise ProfileError(f"{what}: {problem}")


@contextmanager
def writing(flag: str, path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn an ``OSError`` while writing ``path`` (a disk that filled up during the sweep) into one line."""
    try:
        yield
    except OSError as err:
        raise ProfileError(f"{flag} {path}: cannot write: {err.strerror or err}") from None


def check_writable_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` is a writable directory, or can be created inside a writable one."""
    target = Path(path)
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ProfileError(f"{flag} {target}: {existing} is not a directory")
    _probe(existing, f"{flag} {target}")
    return target
