"""Timing one collective in every group of a layout at once, as training runs them (all groups busy together).

Each rank times its own group's collective from its own release from a barrier of the group (warm-up, repetitions);
each repetition's time is the group's call from its last rank's arrival (:func:`from_last_arrival`), the slowest
group's where several run at once, and the point is the median (or trimmed mean) of those, known to every rank.
Message sizes are bytes *per rank*: the buffer an all-reduce or all-to-all works on, the gathered output of an
all-gather, the input of a reduce-scatter — the sizes galva-search's cost model prices.
"""

from __future__ import annotations

import random
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from enum import Enum

import torch
import torch.distributed as dist

from galva_comm.groups import ProcessGroupCache
from galva_comm.layout import Group
from galva_profiler.distributed import World, max_over_ranks, synchronize
from galva_profiler.timing import Repeats, median_ms, repetitions_ms

MIB = 2**20


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"


def group_of(groups: list[Group], rank: int) -> Group:
    """The group among ``groups`` that holds ``rank``."""
    for group in groups:
        if rank in group:
            return group
    raise ValueError(f"rank {rank} is in none of the groups {groups}")


def _elements(message_bytes: int, n: int) -> int:
    """fp32 elements of a buffer of about ``message_bytes``, rounded to a multiple of ``n`` (shards must be equal)."""
    return max(n, (message_bytes // 4) // n * n)


def _operation(kind: Collective, numel: int, pg: dist.ProcessGroup, n: int, device: torch.device) -> Callable[[], None]:
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    if kind is Collective.ALL_REDUCE:
        return lambda: dist.all_reduce(buf, group=pg)
    if kind is Collective.ALL_GATHER:
        shard = torch.ones(numel // n, dtype=torch.float32, device=device)

        def gather() -> None:
            with warnings.catch_warnings():  # *_into_tensor is deprecated in favour of *_single in newest torch
                warnings.simplefilter("ignore", FutureWarning)
                dist.all_gather_into_tensor(buf, shard, group=pg)

        return gather
    if kind is Collective.REDUCE_SCATTER:
        out = torch.empty(numel // n, dtype=torch.float32, device=device)

        def scatter() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                dist.reduce_scatter_tensor(out, buf, group=pg)

        return scatter
    out = torch.empty_like(buf)
    return lambda: dist.all_to_all_single(out, buf, group=pg)


def time_collective(
    kind: Collective,
    groups: list[Group],
    message_bytes: int,
    world: World,
    cache: ProcessGroupCache,
    repeats: Repeats,
) -> float:
    """ms per ``kind`` of ``message_bytes`` per rank, run in all ``groups`` at once: the median over the repetitions
    of each one's call from its group's last arrival, the slowest group's (:func:`from_last_arrival`)."""
    group = group_of(groups, world.rank)
    pg = cache.get(group)
    n = len(group)
    run = _operation(kind, _elements(message_bytes, n), pg, n, world.device)
    times = repetitions_ms(run, repeats, world.device, before=lambda: dist.barrier(group=pg))
    return statistics.median(from_last_arrival(times, groups, world))


def from_last_arrival(times_ms: Sequence[float], groups: list[Group], world: World) -> list[float]:
    """Per repetition, a call's time from its group's last arrival: the least of the group's ranks' times (each rank
    timed from its own release from the barrier before it), and where several groups run at once the slowest
    group's; collective, the same list on every rank.

    Why the least: a barrier releases its ranks one by one, and a rank released early waits in the call for the last
    one; on 4 CPU ranks sharing 2 cores the release spread read 5.1-5.5 ms (0.02 ms at 2 ranks), so the slowest rank's
    time, which the points kept before, held a 4 KiB all-reduce at 6.0-6.5 ms where the step's own world all-reduces
    took 2.3-6.0 ms from the last rank's arrival (``benchmarks/costmodel/README.md``, set H). In a step the ranks'
    arrival is the slowest rank's work, priced as its own; what a call adds is from the last arrival on, which the
    last-released rank times: it waits for no one."""
    local = torch.tensor(list(times_ms), dtype=torch.float64, device=world.device)
    gathered = [torch.empty_like(local) for _ in range(world.size)]
    dist.all_gather(gathered, local)
    by_rank = torch.stack(gathered)
    per_group = torch.stack([by_rank[list(group)].min(dim=0).values for group in groups])
    return [float(ms) for ms in per_group.max(dim=0).values.cpu()]


SMALL_ROUNDS = 4
"""How many times the rounds a curve's latency-bound points (at most an eighth of its largest message) are timed."""


def time_curve(
    kind: Collective,
    groups: list[Group],
    sizes_bytes: Sequence[int],
    world: World,
    cache: ProcessGroupCache,
    repeats: Repeats,
) -> list[float]:
    """:func:`time_collective` at every size, round robin in a shuffled order: each repetition (and warm-up) runs
    every size once, so a drift of a shared machine's load falls on all points of the curve alike, not on one size's
    run of repetitions (timed size after size, one quickstart's 4-rank all-reduce read 11.3, 22.9 and 23.8 ms at 1, 2
    and 4 MiB); each point is the :func:`trimmed_mean` of its repetitions, the slowest rank's.

    Why shuffled and a mean: a small call's time on CPU ranks is bimodal (a waiting rank woken at once, or only at
    the scheduler's next tick, about 3 ms later), and in a fixed order each size kept its phase against the tick
    repetition after repetition: one quiet 2-rank all-reduce curve read 0.73, 3.60, 1.06, 3.90, 2.01 ms at 4 KiB,
    0.25, 0.5, 1 and 2 MiB (medians of 7), the next profile's points each in the other mode. A random order (the same
    on every rank) gives every size every phase, and the mean is what a step pays over its calls. Each repetition is
    its call from the group's last arrival (:func:`from_last_arrival`)."""
    group = group_of(groups, world.rank)
    pg = cache.get(group)
    n = len(group)
    runs = [_operation(kind, _elements(size, n), pg, n, world.device) for size in sizes_bytes]
    times: list[list[float]] = [[] for _ in runs]
    # the latency-bound points (the mode's share is what their mean measures) get SMALL_ROUNDS times the rounds:
    # they cost little, and with 7 rounds one quiet 2-rank 4 KiB all-reduce read 2.9 ms and the next 1.4
    small = {k for k, size in enumerate(sizes_bytes) if size * 8 <= max(sizes_bytes, default=0)}
    full = repeats.warmup + repeats.repetitions
    for index in range(repeats.warmup + repeats.repetitions * SMALL_ROUNDS):
        order = [k for k in range(len(runs)) if index < full or k in small]
        random.Random(index).shuffle(order)  # seeded by the repetition: the same order on every rank
        for k in order:
            dist.barrier(group=pg)
            synchronize(world.device)
            start = time.perf_counter()
            runs[k]()
            synchronize(world.device)
            if index >= repeats.warmup:
                times[k].append((time.perf_counter() - start) * 1e3)
    return [trimmed_mean(from_last_arrival(timed, groups, world)) for timed in times]


def trimmed_mean(values: Sequence[float]) -> float:
    """The mean without the fastest and the slowest fifth (at least one each from 5 values up): the expected time of
    a bimodal call, without a burst of outside load."""
    ordered = sorted(values)
    cut = len(ordered) // 5
    kept = ordered[cut : len(ordered) - cut] if cut else ordered
    return statistics.fmean(kept)


def bus_bandwidth_gb_per_s(message_bytes: int, n: int, ms: float) -> float:
    """nccl-tests' all-reduce bus bandwidth: ``2(n-1)/n * bytes / time``, in 1e9 bytes per second."""
    return 2 * (n - 1) / n * message_bytes / (ms * 1e-3) / 1e9


def middle_stages(pipelines: list[Group], rank: int) -> tuple[int, int]:
    """The ranks of stages ``pp/2 - 1`` and ``pp/2`` of ``rank``'s pipeline: the boundary every pipeline has."""
    pipeline = group_of(pipelines, rank)
    middle = len(pipeline) // 2
    return pipeline[middle - 1], pipeline[middle]


def time_p2p(pipelines: list[Group], message_bytes: int, world: World, repeats: Repeats) -> float:
    """ms to send ``message_bytes`` between the two middle stages of every pipeline at once; max over ranks.

    Stage ``pp/2 - 1`` sends to stage ``pp/2`` (the reference's choice: the boundary every pipeline has). Ranks
    outside that pair only join the barrier, so they time ~0 and the max is the pair's time.
    """
    sender, receiver = middle_stages(pipelines, world.rank)
    buf = torch.ones(_elements(message_bytes, 1), dtype=torch.float32, device=world.device)

    def transfer() -> None:
        if world.rank == sender:
            dist.send(buf, dst=receiver)
        elif world.rank == receiver:
            dist.recv(buf, src=sender)

    ms = median_ms(transfer, repeats, world.device, before=dist.barrier)
    return max_over_ranks(ms, world.device)
