"""Checks made before anything is measured, so that a bad output path fails in a second, not after the sweep."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from galva_profiler.errors import ProfileError


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
    """Create and remove a file in ``directory``: permission bits say nothing for root or on special file systems."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".galva-profile-probe-"):
            pass
    except OSError as err:
        raise ProfileError(f"{what}: not writable ({err.strerror})") from None


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
