"""How much compute and communication slow each other down when they run at the same time (measured).

Three timings on every rank: a matmul loop alone, a chain of all-reduces on the whole world alone, and both together
(the all-reduces issued with ``async_op=True`` first, then the matmul loop on the calling thread; on GPUs the
collectives run on their own stream, on gloo in gloo's own threads). The loop is sized so that both take about the
same time alone, which is where they interfere most. Each side's slowdown is its time together over its time alone;
the profile's ``overlap_slowdown`` is the larger of the two (at least 1), as the reference defines it.

A fourth measurement, beside it, gives the **compute slowdown of running every rank at once**
(:mod:`galva_profiler.concurrency`): the profile's ``compute_slowdown``.

Beside it, :func:`node_processors` records the processors the ranks may compute on (CPU ranks: the union of their CPU
affinity), the profile's ``processors_per_node``: fewer than the ranks, and the ranks share them (a rank idle in a
pipeline bubble hands its processor to another, which galva-search prices).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from galva_profiler.concurrency import CONCURRENCY_ROUNDS, LOOP_MS, MIN_ROUNDS, measure_concurrency
from galva_profiler.distributed import World, max_over_ranks, synchronize
from galva_profiler.timing import Repeats, median_ms


@dataclass(frozen=True)
class OverlapResult:
    compute_ms: float
    comm_ms: float
    compute_overlapped_ms: float
    comm_overlapped_ms: float
    compute_alone_ms: float = 0.0  # the loop on rank 0 while the others wait (0: not measured)
    concurrency_ratio: float = 1.0  # median over paired repetitions of (every rank at once) / (rank 0 alone)
    reference_ms: float = 0.0  # the reference matmul on rank 0 alone (reference_speed; 0: not measured)

    @property
    def concurrency_slowdown(self) -> float:
        """Compute time with every rank running against one rank alone (at least 1)."""
        return max(1.0, self.concurrency_ratio)

    @property
    def compute_slowdown(self) -> float:
        return self.compute_overlapped_ms / self.compute_ms

    @property
    def comm_slowdown(self) -> float:
        return self.comm_overlapped_ms / self.comm_ms

    @property
    def slowdown(self) -> float:
        """What the profile stores: the larger slowdown, never below 1 (overlap cannot make either faster)."""
        return max(1.0, self.compute_slowdown, self.comm_slowdown)

    def to_dict(self) -> dict[str, float]:
        return {
            "compute_ms": self.compute_ms,
            "comm_ms": self.comm_ms,
            "compute_overlapped_ms": self.compute_overlapped_ms,
            "comm_overlapped_ms": self.comm_overlapped_ms,
            "compute_slowdown": self.compute_slowdown,
            "comm_slowdown": self.comm_slowdown,
            "overlap_slowdown": self.slowdown,
            "compute_alone_ms": self.compute_alone_ms,
            "concurrency_slowdown": self.concurrency_slowdown,
            "reference_ms": self.reference_ms,
        }


def measure_overlap(
    world: World,
    message_bytes: int,
    matmul_size: int,
    comm_calls: int,
    repeats: Repeats,
    rounds: int = MIN_ROUNDS,
    concurrency_ms: float = LOOP_MS,
    concurrency_span_s: float = 0.0,
) -> OverlapResult:
    """Time compute alone, communication alone and both overlapped, in at least ``rounds`` alternating rounds (each
    value the max over ranks of the rank's median); then the concurrency test
    (:func:`galva_profiler.concurrency.measure_concurrency`)."""
    device = world.device
    a = torch.randn(matmul_size, matmul_size, device=device)
    b = torch.randn(matmul_size, matmul_size, device=device)
    buf = torch.ones(max(1, message_bytes // 4), dtype=torch.float32, device=device)

    one_matmul = median_ms(lambda: torch.mm(a, b), repeats, device)
    comm_ms = max_over_ranks(
        median_ms(lambda: [dist.all_reduce(buf) for _ in range(comm_calls)], repeats, device, before=dist.barrier),
        device,
    )
    # as many matmuls as fit in the communication time, agreed so that every rank runs the same loop
    iterations = int(max_over_ranks(max(1.0, round(comm_ms / max(one_matmul, 1e-6))), device))

    def compute() -> None:
        for _ in range(iterations):
            torch.mm(a, b)

    def chain() -> None:
        for _ in range(comm_calls):
            dist.all_reduce(buf)

    def both() -> tuple[float, float]:
        """(compute ms, communication ms) from one start, the all-reduces in flight while the loop runs."""
        finished: list[float] = []
        start = time.perf_counter()
        works = [dist.all_reduce(buf, async_op=True) for _ in range(comm_calls)]
        # the callback runs when the last all-reduce completes, wherever the compute loop is by then
        stamped = works[-1].get_future().then(lambda _, stamps=finished: stamps.append(time.perf_counter()))
        compute()
        synchronize(device)
        compute_done = time.perf_counter()
        for work in works:
            work.wait()
        stamped.wait()  # the callback has run: ``finished`` holds the completion time
        return (compute_done - start) * 1e3, (finished[0] - start) * 1e3

    # the three timings alternate round by round: a drift of a shared machine's load falls on both sides of a ratio
    sides: dict[str, list[float]] = {"compute": [], "comm": [], "compute_overlapped": [], "comm_overlapped": []}
    for index in range(repeats.warmup + max(repeats.repetitions, rounds)):
        compute_alone = _timed_ms(compute, device)
        comm_alone = _timed_ms(chain, device)
        dist.barrier()
        synchronize(device)
        together = both()
        if index >= repeats.warmup:
            for side, ms in zip(sides, (compute_alone, comm_alone, *together)):
                sides[side].append(ms)
    # the compute slowdown scales every layer's price: twice the rounds of the other tests (3 quickstarts' 4-rank
    # profiles of one quiet quarter hour read 2.62, 2.14 and 2.47 over 7 rounds)
    compute_alone_ms, concurrency_ratio, reference_ms = measure_concurrency(
        world, matmul_size, repeats, CONCURRENCY_ROUNDS * rounds // MIN_ROUNDS, concurrency_ms, concurrency_span_s
    )
    slowest = {side: max_over_ranks(statistics.median(times), device) for side, times in sides.items()}
    return OverlapResult(
        compute_ms=slowest["compute"],
        comm_ms=slowest["comm"],
        compute_overlapped_ms=slowest["compute_overlapped"],
        comm_overlapped_ms=slowest["comm_overlapped"],
        compute_alone_ms=compute_alone_ms,
        concurrency_ratio=concurrency_ratio,
        reference_ms=reference_ms,
    )


def _timed_ms(run: Callable[[], None], device: torch.device) -> float:
    """``run()`` on every rank from a barrier, this rank's ms."""
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def node_processors(world: World) -> int | None:
    """Processors the ranks may compute on: on CPU the union of every rank's ``os.sched_getaffinity`` (ranks of
    several nodes are taken to see alike-numbered cores); None on GPU, where each rank computes on its own device."""
    if world.device.type != "cpu" or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    union = torch.zeros(int(max_over_ranks(float(cpus[-1] + 1), world.device)), dtype=torch.float64)
    union[cpus] = 1.0
    dist.all_reduce(union, op=dist.ReduceOp.MAX)  # a processor any rank may use
    return int(union.sum().item())
