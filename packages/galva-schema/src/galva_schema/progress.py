"""Progress on stderr that suits where stderr goes: a redrawn bar on a terminal, plain lines anywhere else.

A tqdm bar redraws itself with carriage returns; sent to a file or a pipe (a log, ``galva run``'s stage logs, CI) the
frames pile up instead (11 KB for a 30-step run). :func:`progress_bar` decides once, from the stream: on a terminal
a tqdm bar; elsewhere a :class:`LineProgress`, one plain line at most every ``interval_s`` seconds and one at the end;
disabled, nothing. All three answer ``update``, ``set_postfix``, ``write`` (a line of its own, also when disabled)
and ``close``, and are context managers. galva-schema does not depend on tqdm: it is imported only for a terminal
(the distributions that show bars depend on it), and without it a terminal gets the plain lines too.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, TextIO

__all__ = ["LineProgress", "NoProgress", "progress_bar"]


class NoProgress:
    """Progress turned off: counts, prints only what :meth:`write` is given."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **values: Any) -> None:
        pass

    def write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> Any:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class LineProgress(NoProgress):
    """Plain lines for a stream that is not a terminal: ``label: done/total unit, elapsed, key=value ...`` at most
    every ``interval_s`` seconds (the first after ``interval_s``), and a last one on :meth:`close`."""

    def __init__(
        self,
        total: int | None,
        label: str,
        *,
        unit: str = "it",
        stream: TextIO | None = None,
        interval_s: float = 10.0,
    ) -> None:
        super().__init__(stream)
        self.total, self.label, self.unit, self.interval_s = total, label, unit, interval_s
        self._postfix: dict[str, Any] = {}
        self._start = self._last = time.monotonic()
        self._closed = False
        self._shown = -1

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self._line()

    def set_postfix(self, **values: Any) -> None:
        self._postfix = values

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.n != self._shown:  # the end, unless the last line already said it
                self._line()

    def _line(self) -> None:
        self._shown = self.n
        done = _amount(self.n, self.unit)
        if self.total is not None:
            done += f"/{_amount(self.total, self.unit)}"
        extra = "".join(f", {key}={value}" for key, value in self._postfix.items())
        elapsed = time.monotonic() - self._start
        self.write(f"{self.label}: {done} {'MiB' if self.unit == 'B' else self.unit}, {elapsed:.0f} s{extra}")


class _Bar(NoProgress):
    """A tqdm bar (on a terminal); :meth:`write` prints above it, on its own stream."""

    def __init__(self, bar: Any, stream: TextIO) -> None:
        super().__init__(stream)
        self.bar = bar

    def update(self, n: int = 1) -> None:
        self.n += n
        self.bar.update(n)

    def set_postfix(self, **values: Any) -> None:
        self.bar.set_postfix(refresh=False, **values)

    def write(self, line: str) -> None:
        self.bar.write(line, file=self.stream)

    def close(self) -> None:
        self.bar.close()


def _amount(n: int, unit: str) -> str:
    return f"{n / 2**20:.1f}" if unit == "B" else str(n)


def progress_bar(
    total: int | None,
    label: str,
    *,
    unit: str = "it",
    enabled: bool = True,
    stream: TextIO | None = None,
    interval_s: float = 10.0,
) -> Any:
    """A progress display for ``stream`` (default: ``sys.stderr`` now): a tqdm bar on a terminal, a
    :class:`LineProgress` elsewhere, a :class:`NoProgress` when not ``enabled``. ``unit="B"`` counts bytes (the bar
    scales them, the lines show MiB)."""
    stream = stream if stream is not None else sys.stderr
    if not enabled:
        return NoProgress(stream)
    if _is_terminal(stream):
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            scaled = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
            bar = tqdm(total=total, desc=label, unit=unit, file=stream, dynamic_ncols=True, mininterval=0.2, **scaled)
            return _Bar(bar, stream)
    return LineProgress(total, label, unit=unit, stream=stream, interval_s=interval_s)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or a file-like object without a descriptor
        return False
