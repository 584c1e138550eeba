"""A training run's save directory: ``<root>/step-<NNNNNNNN>/`` checkpoints, the newest complete one found on load.

A save in progress is ``step-<N>.tmp-<token>/`` and becomes ``step-<N>/`` only when complete (manifest written,
every rank done). A directory without a manifest is a save that died: :func:`latest_checkpoint` ignores it with a
one-line warning. :func:`prune` keeps the newest ``keep`` complete saves.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from galva_ckpt.format import MANIFEST

__all__ = ["complete_saves", "latest_checkpoint", "prune", "step_dir"]

_STEP = re.compile(r"^step-(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    """Where the save of ``step`` goes."""
    return Path(root) / f"step-{step:08d}"


def complete_saves(root: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete save under ``root``, oldest first."""
    root = Path(root)
    out = []
    for child in root.iterdir() if root.is_dir() else ():
        match = _STEP.match(child.name)
        if match and (child / MANIFEST).is_file():
            out.append((int(match.group(1)), child))
    return sorted(out)


def latest_checkpoint(root: str | Path, warn: bool = True) -> Path | None:
    """The newest complete save under ``root`` (None if there is none); partial saves are named in a warning."""
    root = Path(root)
    partial = sorted(
        child.name
        for child in (root.iterdir() if root.is_dir() else ())
        if child.name.startswith("step-") and not (child / MANIFEST).is_file()
    )
    if partial and warn:
        print(
            f"galva-ckpt: warning: ignoring incomplete save {root / partial[-1]}"
            + (f" (and {len(partial) - 1} more)" if len(partial) > 1 else "")
            + " (interrupted before its manifest was written)",
            file=sys.stderr,
        )
    saves = complete_saves(root)
    return saves[-1][1] if saves else None


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete saves (``keep`` < 1 keeps all); returns what was deleted."""
    if keep < 1:
        return []
    old = [path for _, path in complete_saves(root)[:-keep]]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old
