"""Checks made before anything is measured, so that a bad output path fails in a second, not after the sweep."""

from __future__ import annotations

import os
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
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ProfileError(f"{flag} {target}: not writable")
    return target


def check_writable_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` is a writable directory, or can be created inside a writable one."""
    target = Path(path)
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ProfileError(f"{flag} {target}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ProfileError(f"{flag} {target}: not writable")
    return target
