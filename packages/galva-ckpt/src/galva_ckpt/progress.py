"""The progress bar of h2g and g2h: bytes converted, on stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tqdm import tqdm

__all__ = ["progress_bar"]


@contextmanager
def progress_bar(total_bytes: int, label: str, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(nbytes)``; the bar shows bytes done, throughput and time left."""
    with tqdm(
        total=total_bytes, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
        disable=not enabled, mininterval=0.2,
    ) as bar:  # fmt: skip
        yield bar.update
