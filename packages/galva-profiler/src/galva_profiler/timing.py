"""Timing one operation: warm-up, repetitions, median.

The median of individually timed repetitions is robust to the occasional slow repetition (another process on a
shared machine, a page fault), which a mean over a loop is not.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from galva_profiler.distributed import synchronize


@dataclass(frozen=True)
class Repeats:
    """How often to run an operation before (``warmup``) and while (``repetitions``) timing it."""

    warmup: int = 3
    repetitions: int = 10

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.repetitions < 1:
            raise ValueError(f"warmup must be >= 0 and repetitions >= 1, got {self.warmup} and {self.repetitions}")


def median_ms(
    run: Callable[[], object],
    repeats: Repeats,
    device: torch.device,
    before: Callable[[], object] | None = None,
) -> float:
    """Median wall time of ``run()`` in ms; ``before()`` runs untimed ahead of each call (e.g. a barrier)."""
    for _ in range(repeats.warmup):
        if before is not None:
            before()
        run()
    synchronize(device)
    times = []
    for _ in range(repeats.repetitions):
        if before is not None:
            before()
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
