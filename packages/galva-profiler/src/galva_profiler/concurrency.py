"""The compute slowdown of every rank computing at once against one rank alone: the profile's ``compute_slowdown``.

The model profile times a layer in one process; the job runs every rank at once. Where ranks share cores (4 CPU
processes on 2 cores) each computes at about half speed; with a device per rank the ratio is about 1 (shared memory
bandwidth or PCIe aside). Measured with a matmul loop, in rounds: every rank runs the loop at once, then rank 0 runs
it alone while the others wait; each round gives one ratio, and the figure is the median of the rounds' ratios.

Rank 0 alone computes with the intra-op threads of the process that launched the ranks
(``GALVA_PROFILE_ALONE_THREADS``, set by ``galva-profile --nproc-per-node``: what the single-process model profile
computes with), the ranks together with their own; ``galva run`` gives both one rank's share of the cores.

What makes the figure repeat run after run on a shared machine (it read 2.55, 1.65 and 2.14 in three quickstarts
of one quiet hour when the loop was the overlap test's, sized by its communication time: 30, 16 and 22 ms alone,
the shortest loop reading lowest):

* the loop has a fixed length, :data:`LOOP_MS` on rank 0 alone, long against the scheduler's slices: on 4 ranks
  over 2 cores a short loop can let a rank that was woken late find the others' loops nearly done;
* every rank at once is timed from the barrier to the last rank's end (:func:`galva_profiler.timing.span_ms`), as
  a step that waits for every rank sees it, not each rank from its own start;
* the two alternate round by round (a drift of the machine's load falls on both sides of a ratio), at least
  :data:`CONCURRENCY_ROUNDS` rounds in a profile (the hardware sweep scales them with its other tests' rounds), and
  for a few seconds at least (a burst of a slower processor lasts seconds, and 15 rounds take two).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from galva_profiler.distributed import World, max_over_ranks, synchronize
from galva_profiler.reference_speed import ReferenceClock
from galva_profiler.timing import Repeats, median_ms, together_ms

LOOP_MS = 40.0
"""How long the loop takes on rank 0 alone."""
MIN_ROUNDS = 7
CONCURRENCY_ROUNDS = 15
"""Rounds of this test when the others take :data:`MIN_ROUNDS` (it scales with them): its ratio prices every layer."""
ALONE_THREADS_ENV = "GALVA_PROFILE_ALONE_THREADS"
REFERENCE_SAMPLES = 3
"""Samples of the reference matmul after each round's alone loop (a few ms)."""


@contextmanager
def alone_threads() -> Iterator[None]:
    """Inside the block, torch computes with the launching process's thread count (unchanged where none was set)."""
    before = torch.get_num_threads()
    wanted = int(os.environ.get(ALONE_THREADS_ENV, before) or before)
    torch.set_num_threads(max(1, wanted))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_concurrency(
    world: World,
    matmul_size: int,
    repeats: Repeats,
    rounds: int = MIN_ROUNDS,
    loop_ms: float = LOOP_MS,
    span_s: float = 0.0,
) -> tuple[float, float, float]:
    """(rank 0 alone ms, median over at least ``rounds`` rounds of every-rank-at-once / alone, the reference
    matmul's ms on rank 0 alone), a loop of about ``loop_ms`` alone; the rounds go on until their timed loops add up
    to ``span_s`` seconds (:data:`galva_profiler.timing.TIMING_SPAN_S`); the same values on every rank.

    The reference (:mod:`galva_profiler.reference_speed`) is sampled on rank 0 alone after each round's alone loop,
    :data:`REFERENCE_SAMPLES` times: the model profile's layers are priced in this test's minutes through it."""
    device = world.device
    a = torch.randn(matmul_size, matmul_size, device=device)
    b = torch.randn(matmul_size, matmul_size, device=device)
    loop = _loop(lambda: torch.mm(a, b), world, loop_ms)
    reference = ReferenceClock(device)
    alone, ratios = [], []
    timed_ms = 0.0  # of values every rank holds alike: every rank ends after the same round
    index = 0
    while index < repeats.warmup + max(repeats.repetitions, rounds) or timed_ms < span_s * 1e3:
        together = together_ms(loop, world)
        one = _alone_ms(loop, world)
        _sample_alone(reference, world, index >= repeats.warmup)
        if index >= repeats.warmup:
            alone.append(one)
            ratios.append(together / one)
            timed_ms += together + one
        index += 1
    reference_ms = max_over_ranks(reference.median_ms() or 0.0, device)  # rank 0's; the others hold none
    return statistics.median(alone), statistics.median(ratios), reference_ms


def _sample_alone(reference: ReferenceClock, world: World, keep: bool) -> None:
    """:data:`REFERENCE_SAMPLES` samples of ``reference`` on rank 0 while the others wait (dropped unless
    ``keep``: a warm-up round's)."""
    dist.barrier()
    if world.rank == 0:
        with alone_threads():
            for _ in range(REFERENCE_SAMPLES):
                reference.sample()
        if not keep:
            reference.samples.clear()
    dist.barrier()


def _loop(call: Callable[[], object], world: World, loop_ms: float) -> Callable[[], None]:
    """``call`` repeated as often as fits in ``loop_ms`` on rank 0 alone (agreed: every rank runs the same)."""
    calls = 1.0
    if world.rank == 0:  # the others wait in the all-reduce below
        with alone_threads():
            calls = max(1.0, round(loop_ms / max(median_ms(call, Repeats(2, 5), world.device), 1e-6)))
    count = int(max_over_ranks(calls, world.device))

    def loop() -> None:
        for _ in range(count):
            call()

    return loop


def _alone_ms(run: Callable[[], None], world: World) -> float:
    """``run()`` on rank 0 while the others wait, in ms, known to every rank."""
    dist.barrier()
    ms = 0.0
    if world.rank == 0:
        with alone_threads():
            synchronize(world.device)
            start = time.perf_counter()
            run()
            synchronize(world.device)
            ms = (time.perf_counter() - start) * 1e3
    return max_over_ranks(ms, world.device)
