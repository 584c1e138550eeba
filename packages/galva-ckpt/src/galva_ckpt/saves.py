"""A training run's save directory: ``<root>/step-<NNNNNNNN>/`` checkpoints, the newest complete one found on load.

A save in progress is ``step-<N>.tmp-<token>/`` and becomes ``step-<N>/`` only when complete (manifest written,
every rank done). A directory without a manifest is a save that died: :func:`latest_checkpoint` ignores it with a
one-line warning. :func:`prune` keeps the newest ``keep`` complete saves.

A save directory has one owner at a time: :class:`SaveDirLock`, an exclusive ``flock`` on ``<root>/.galva-save.lock``
held by the run for its whole length. The kernel drops the lock when its holder dies, so a killed run never blocks
the next one, and resuming into the same directory after a run ended takes the lock anew.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from types import TracebackType

from galva_ckpt.errors import CheckpointError
from galva_ckpt.format import MANIFEST

__all__ = ["LOCK_FILE", "SaveDirBusy", "SaveDirLock", "complete_saves", "latest_checkpoint", "prune", "step_dir"]

LOCK_FILE = ".galva-save.lock"
"""The lock file inside a save directory; it names its holder (``pid N on host H``)."""

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


class SaveDirBusy(CheckpointError):
    """Another live process owns the save directory; ``str()`` names the directory and that process."""


class SaveDirLock:
    """Ownership of the save directory ``root`` for one run (see the module docstring); a context manager.

    :meth:`acquire` raises :class:`SaveDirBusy` when another process holds it, and ``OSError`` when the file system
    cannot lock (the caller decides whether to go on unprotected). :meth:`release` removes the lock file.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> SaveDirLock:
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise SaveDirBusy(
                    f"{self.root}: in use by another run ({holder}); wait for it to end or choose another directory"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            # the previous owner removes the file on release: if it did so between our open and our lock, the lock
            # is on a file nobody else will see; start again on the path's current file
            try:
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = -1
            if current == os.fstat(fd).st_ino:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the directory up (idempotent): remove the lock file while still holding it, then unlock."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> SaveDirLock:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it (it may not have written yet: then unnamed)."""
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text.splitlines()[0] if text else "a process that has not named itself yet"
