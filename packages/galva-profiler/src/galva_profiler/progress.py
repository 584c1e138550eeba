"""A progress bar on stderr, shown by one process (rank 0) only.

On a terminal the bar redraws in place; otherwise (a log file, CI) each step is one line, so a long sweep still
shows where it is.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``total`` steps; :meth:`step` advances by one and names what runs next."""

    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self._start = time.monotonic()
        self._tty = self.stream.isatty()

    def step(self, what: str) -> None:
        """Mark one step done; ``what`` is the step just finished."""
        self.done = min(self.total, self.done + 1)
        if not self.enabled:
            return
        width = 24
        filled = width * self.done // self.total
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self._start
        text = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:6.1f}s {what}"
        self.stream.write(f"\r{text}\033[K" if self._tty else text + "\n")
        if self._tty and self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()
