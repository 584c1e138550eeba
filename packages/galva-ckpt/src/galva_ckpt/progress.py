"""The progress of h2g and g2h: bytes converted, on stderr (a bar on a terminal, plain lines in a log)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from galva_schema.progress import progress_bar as _progress

__all__ = ["progress_bar"]


@contextmanager
def progress_bar(total_bytes: int, label: str, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(nbytes)``; the bar shows bytes done, throughput and time left."""
    with _progress(total_bytes, label, unit="B", enabled=enabled) as bar:
        yield bar.update
