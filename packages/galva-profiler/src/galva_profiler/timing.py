"""Timing one operation: warm-up, repetitions, median; and one call on every rank at once, first start to last end.

The median of individually timed repetitions is robust to the occasional slow repetition (another process on a
shared machine, a page fault), which a mean over a loop is not.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from galva_profiler.distributed import World, max_over_ranks, synchronize

TIMING_SPAN_S = 5.0
"""Seconds the rounds of a speed measurement span at least, by default (a layer's passes, the compute slowdown).

A shared machine's processors change speed in bursts of seconds: on a quiet 2-core VM, one thread timing a layer's
forward second by second read 1.5-1.8 ms most seconds and 2.4-3.3 ms in bursts of 1-5 s, one processor at a time.
Rounds that take a third of a second (seven of the quickstart's layer) or two seconds (the compute slowdown's 15)
can all fall in one burst: the quickstart's layer profile read 1.5x its usual time in one run of three, and one
4-rank hardware profile's compute slowdown read 3.9 where the others read 2.2-2.4. Over seconds, the median of the
rounds is the usual state, as the job's median step time is."""


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
    return statistics.median(repetitions_ms(run, repeats, device, before))


def repetitions_ms(
    run: Callable[[], object],
    repeats: Repeats,
    device: torch.device,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Wall time of each timed ``run()`` in ms, after the warm-up; ``before()`` as :func:`median_ms`."""
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
    return times


def span_ms(start: float, end: float, world: World) -> float:
    """Wall ms from the first rank's ``start`` to the last rank's ``end`` (``time.perf_counter`` stamps), known to
    every rank: what a step that waits for all of them sees, a rank that was scheduled late included.

    ``perf_counter`` is the machine's monotonic clock, one for all its processes; nodes' clocks differ, so across
    nodes this is the slowest rank's own time (every rank of a node shares its cores, not another node's).
    """
    if world.num_nodes > 1:
        return max_over_ranks((end - start) * 1e3, world.device)
    stamps = torch.tensor([-start, end], dtype=torch.float64, device=world.device)
    dist.all_reduce(stamps, op=dist.ReduceOp.MAX)
    return float(stamps[1] + stamps[0]) * 1e3


def together_ms(run: Callable[[], object], world: World) -> float:
    """One call of ``run()`` on every rank at once, timed by :func:`span_ms` from a barrier (collective)."""
    dist.barrier()
    synchronize(world.device)
    start = time.perf_counter()
    run()
    synchronize(world.device)
    return span_ms(start, time.perf_counter(), world)
