"""The hardware sweep: what is measured, in which order, and the HardwareProfile built from it.

The sweep is planned first (:func:`plan_sweep`, pure: the same list on every rank, so every rank runs the same
collectives in the same order, and the progress bar knows its length), then run step by step (:func:`run_sweep`).

Measured, for every power-of-two group size ``n`` from 2 up to the world (or ``max_group_size``; none on a world of
one device, which measures only its base memory and optimizer rate):

* all-reduce bus bandwidth at ``bandwidth_mib``, groups of consecutive ranks and groups strided by ``W/n``
  (galva_comm.layout's two layouts; the world-sized group has one layout);
* all-reduce, all-gather, reduce-scatter and all-to-all time against message size, consecutive groups, the sizes
  of one curve timed round robin; an alpha-beta line fitted per group size with its residuals;
* what one call of each collective costs inside a busy step beyond the curve's 4 KiB time, every rank alternating
  compute segments and calls (:mod:`galva_profiler.busy_calls`);
* p2p bandwidth between the middle stages of pipelines of degree ``pp`` (galva_comm.layout's pipeline groups), and
  the latency of one send (a 4 KiB send's time less what the bandwidth explains; the least median of
  :data:`P2P_BLOCKS` blocks);
* the overlap slowdown of compute and communication, and the compute slowdown of every rank computing at once
  against one alone (:mod:`galva_profiler.overlap`);
* first, before any buffer of the sweep exists, the base memory of one rank's process
  (:mod:`galva_profiler.base_memory`); then the AdamW step's rate per parameter (:mod:`galva_profiler.optimizer_step`).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any

import torch

from galva_comm.groups import ProcessGroupCache
from galva_comm.layout import Group, model_parallel_groups, pipeline_groups
from galva_profiler.base_memory import RUNTIME_MODULES, measure_base_memory
from galva_profiler.busy_calls import SEGMENT_MS, busy_calls_ms, busy_send_ms
from galva_profiler.collectives import (
    MIB,
    Collective,
    bus_bandwidth_gb_per_s,
    time_collective,
    time_curve,
    time_p2p,
)
from galva_profiler.concurrency import LOOP_MS, MIN_ROUNDS
from galva_profiler.distributed import World
from galva_profiler.fitting import Fit, alpha_beta
from galva_profiler.optimizer_step import measure_optimizer_rate
from galva_profiler.overlap import OverlapResult, measure_overlap, node_processors
from galva_profiler.progress import Progress
from galva_profiler.timing import TIMING_SPAN_S, Repeats
from galva_schema import (
    AllreduceBandwidth,
    CallExtra,
    ClusterSpec,
    CollectiveTimes,
    HardwareProfile,
    P2PBandwidth,
)

P2P_LATENCY_BYTES = 4096  # a send this small is latency-bound on every interconnect
LATENCY_REPETITIONS = 15
"""Repetitions, at least, of every curve's round robin, its 4 KiB point included (a small message is cheap to repeat,
and its time under outside load needs them: 3 gave 0.67 ms at 0.25 MiB over 2 gloo ranks where the same run's other
sizes took 1-9 ms)."""
P2P_BLOCKS = 3
"""Blocks of the 4 KiB send's repetitions; its latency is the least of their medians. One block spans ~0.1 s, and a
shared box's slow burst can fill it: a 2-rank profile read 3.9 ms where the sends of the minutes around took 0.14-0.22
ms, which priced every message of a pipeline at 3.9 ms (an interleaved plan's gain off by 4 points)."""


def scalar_bytes(group_size: int) -> int:
    """The size of the all-reduce curve's smallest point: one fp32 element per rank, the few numbers the runtime's
    step reduces over the world (the loss's totals, the clip's squared norm). On gloo CPU ranks a call that small
    takes another path than 4 KiB: 4 ranks read 3.2-4.3 ms against 5.1-6.8 at 4 KiB and up (2026-11-28), where the
    step's two such calls took 2.4 and 5.4 ms from their last rank's arrival."""
    return 4 * group_size


TIMED = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL)


@dataclass(frozen=True)
class SweepOptions:
    """Sizes, counts and limits of a sweep (the command's flags)."""

    message_mib: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    bandwidth_mib: float = 64.0
    p2p_mib: float = 64.0
    max_group_size: int | None = None
    max_pp: int | None = None
    repeats: Repeats = field(default_factory=Repeats)
    overlap_mib: float = 16.0
    overlap_matmul: int = 1024
    overlap_calls: int = 4
    timed: tuple[Collective, ...] = TIMED
    optimizer_parameters: int = 16_000_000  # parameters of the timed AdamW step
    rounds: int = MIN_ROUNDS  # timed rounds, at least, of the overlap, concurrency and optimizer tests
    concurrency_ms: float = LOOP_MS  # the concurrency test's loop on rank 0 alone
    runtime_modules: tuple[str, ...] = RUNTIME_MODULES  # imported before the CPU base memory is read
    curve_repetitions: int = LATENCY_REPETITIONS  # at least, of every curve's round robin
    busy_segment_ms: float = SEGMENT_MS  # the compute between two calls of the busy test
    timing_span_s: float = TIMING_SPAN_S  # seconds the concurrency test's rounds span at least

    def __post_init__(self) -> None:
        if len(self.message_mib) < 2 or sorted(set(self.message_mib)) != list(self.message_mib):
            raise ValueError("message sizes must be at least 2 distinct ascending values (an alpha-beta fit needs 2)")
        if min(self.message_mib) <= 0 or self.bandwidth_mib <= 0 or self.p2p_mib <= 0 or self.overlap_mib <= 0:
            raise ValueError("message sizes must be positive")
        if self.rounds < 1 or self.concurrency_ms <= 0 or self.curve_repetitions < 1 or self.busy_segment_ms <= 0:
            raise ValueError("rounds, repetitions and the concurrency and busy loops' lengths must be positive")
        if self.timing_span_s < 0:
            raise ValueError(f"--timing-span must be >= 0 seconds, got {self.timing_span_s:g}")


QUICK = SweepOptions(
    message_mib=(0.25, 0.5, 1, 2, 4),
    bandwidth_mib=4.0,
    p2p_mib=4.0,
    repeats=Repeats(warmup=1, repetitions=5),
    overlap_mib=4.0,
    overlap_matmul=256,
    overlap_calls=2,
    optimizer_parameters=2_000_000,
)
"""A minute-scale sweep (``--quick``): small messages, few repetitions (the overlap, concurrency and optimizer
tests take at least ``rounds``)."""


@dataclass(frozen=True)
class Step:
    """One measurement: a bandwidth, a collective's time curve (every message size and :data:`P2P_LATENCY_BYTES`),
    a collective's cost between compute segments (``busy``), a p2p degree, or the overlap test."""

    kind: str  # "bandwidth" | "time" | "busy" | "p2p" | "overlap"
    group_size: int = 0
    consecutive: bool = True
    collective: Collective = Collective.ALL_REDUCE
    message_mib: float = 0.0

    def describe(self) -> str:
        if self.kind == "bandwidth":
            layout = "consecutive" if self.consecutive else "strided"
            return f"all_reduce bandwidth n={self.group_size} {layout}"
        if self.kind == "time":
            return f"{self.collective.value} n={self.group_size}"
        if self.kind == "busy":
            return f"collectives n={self.group_size} between compute"
        if self.kind == "p2p":
            return f"p2p pp={self.group_size}"
        return "compute/communication overlap"


def group_sizes(world_size: int, limit: int | None = None) -> list[int]:
    """Powers of two from 2 up to ``min(world_size, limit)`` that divide the world size."""
    top = min(world_size, limit or world_size)
    sizes, n = [], 2
    while n <= top:
        if world_size % n == 0:
            sizes.append(n)
        n *= 2
    return sizes


def layout_groups(world_size: int, n: int, consecutive: bool) -> list[Group]:
    """Groups of ``n`` ranks covering the world: consecutive blocks, or ranks strided by ``W/n``."""
    return model_parallel_groups(tuple(range(world_size)), n, consecutive)


def plan_sweep(world_size: int, options: SweepOptions) -> list[Step]:
    """Every measurement of the sweep, in the order all ranks run them."""
    sizes = group_sizes(world_size, options.max_group_size)
    steps = [
        Step("bandwidth", n, consecutive)
        for n in sizes
        for consecutive in ((True, False) if n < world_size else (True,))
    ]
    # every size at once, and the small end of every curve: expert dispatch's row counts, a small layer's gradient
    # sync or ZeRO gather fall below the smallest swept size, where the fitted line's intercept is the least certain
    # number of the profile, so every curve also times 4 KiB (in its round robin: collectives.time_curve)
    steps += [Step("time", n, True, collective) for collective in options.timed for n in sizes]
    # every timed collective of a group size in one round robin (busy_calls.busy_calls_ms)
    steps += [Step("busy", n, True) for n in sizes]
    steps += [Step("p2p", pp) for pp in group_sizes(world_size, options.max_pp)]
    if world_size > 1:  # one rank communicates with nobody and computes alone
        steps.append(Step("overlap"))
    return steps


def sweep_groups(world_size: int, steps: list[Step]) -> list[Group]:
    """Every process group the sweep uses, in a fixed order (they are created up front, collectively)."""
    groups: list[Group] = []
    for step in steps:
        if step.kind in ("bandwidth", "time", "busy"):
            groups += layout_groups(world_size, step.group_size, step.consecutive)
    return groups


@dataclass
class SweepResult:
    """Everything measured: the raw tables (all four collectives), the fits and the overlap test."""

    world_size: int
    bandwidth: dict[tuple[int, bool], float] = field(default_factory=dict)
    times: dict[tuple[Collective, int], dict[float, float]] = field(default_factory=dict)
    p2p: dict[int, float] = field(default_factory=dict)
    p2p_latency_ms: dict[int, float] = field(default_factory=dict)
    busy_call_ms: dict[tuple[Collective, int], float] = field(default_factory=dict)  # between compute, whole
    call_extra_ms: dict[tuple[Collective, int], float] = field(default_factory=dict)  # beyond the curve's 4 KiB
    busy_send_ms: dict[int, float] = field(default_factory=dict)  # by pp: a send between compute segments, whole
    send_extra_ms: dict[int, float] = field(default_factory=dict)  # by pp: beyond the idle 4 KiB send
    overlap: OverlapResult | None = None
    base_memory_mib: float | None = None
    optimizer_ms_per_million_parameters: float = 0.0
    processors: int | None = None  # processors the ranks may compute on (CPU); None: a device per rank

    def fit(self, collective: Collective, n: int) -> Fit:
        points = sorted(self.times[(collective, n)].items())
        return alpha_beta([m for m, _ in points], [t for _, t in points])

    def report(self) -> dict[str, Any]:
        """JSON-ready: every measurement and every fit with its residuals."""
        return {
            "world_size": self.world_size,
            "allreduce_bus_bandwidth_gb_per_s": [
                {"group_size": n, "consecutive": c, "value": v} for (n, c), v in sorted(self.bandwidth.items())
            ],
            "collective_time_ms": [
                {
                    "collective": kind.value,
                    "group_size": n,
                    "message_mib": sorted(table),
                    "time_ms": [table[m] for m in sorted(table)],
                    "alpha_beta_fit": {"ms_per_mib": fit.coefficients[0], "latency_ms": fit.coefficients[1]}
                    | fit.to_dict(),
                }
                for (kind, n), table in sorted(self.times.items(), key=lambda item: (item[0][0].value, item[0][1]))
                for fit in [self.fit(kind, n)]
            ],
            "p2p_bandwidth_gb_per_s": {str(pp): v for pp, v in sorted(self.p2p.items())},
            "call_extra_ms": [
                {"collective": kind.value, "group_size": n, "ms": ms, "busy_ms": self.busy_call_ms[(kind, n)]}
                for (kind, n), ms in sorted(self.call_extra_ms.items(), key=lambda item: (item[0][0].value, item[0][1]))
            ]
            + [
                {"collective": "p2p", "group_size": pp, "ms": ms, "busy_ms": self.busy_send_ms[pp]}
                for pp, ms in sorted(self.send_extra_ms.items())
            ],
            "overlap": self.overlap.to_dict() if self.overlap else None,
            "base_memory_mib": self.base_memory_mib,
            "optimizer_ms_per_million_parameters": self.optimizer_ms_per_million_parameters,
            "processors": self.processors,
        }


def run_sweep(world: World, steps: list[Step], options: SweepOptions, progress: Progress) -> SweepResult:
    """Run ``steps`` on every rank (collective); every rank returns the same result."""
    cache = ProcessGroupCache(backend=world.backend)
    cache.create(sweep_groups(world.size, steps))
    result = SweepResult(world.size, base_memory_mib=measure_base_memory(world, options.runtime_modules))
    result.optimizer_ms_per_million_parameters = measure_optimizer_rate(
        world, options.optimizer_parameters, options.repeats, options.rounds
    )
    result.processors = node_processors(world)
    for step in steps:
        if step.kind == "bandwidth":
            groups = layout_groups(world.size, step.group_size, step.consecutive)
            message = int(options.bandwidth_mib * MIB)
            ms = time_collective(Collective.ALL_REDUCE, groups, message, world, cache, options.repeats)
            result.bandwidth[(step.group_size, step.consecutive)] = bus_bandwidth_gb_per_s(message, step.group_size, ms)
        elif step.kind == "time":  # the swept sizes and the 4 KiB point (an all-reduce's scalar too), one round robin
            groups = layout_groups(world.size, step.group_size, True)
            sizes_mib = [P2P_LATENCY_BYTES / MIB, *options.message_mib]
            if step.collective is Collective.ALL_REDUCE:
                sizes_mib.insert(0, scalar_bytes(step.group_size) / MIB)
            repeats = Repeats(options.repeats.warmup, max(options.repeats.repetitions, options.curve_repetitions))
            curve = time_curve(step.collective, groups, [int(m * MIB) for m in sizes_mib], world, cache, repeats)
            result.times.setdefault((step.collective, step.group_size), {}).update(zip(sizes_mib, curve))
        elif step.kind == "busy":  # after the curves: taken beyond their 4 KiB point
            groups = layout_groups(world.size, step.group_size, True)
            calls = busy_calls_ms(
                options.timed, groups, world, cache, options.repeats, options.rounds, options.busy_segment_ms
            )
            for collective, busy in calls.items():
                result.busy_call_ms[(collective, step.group_size)] = busy
                idle = result.times[(collective, step.group_size)][P2P_LATENCY_BYTES / MIB]
                result.call_extra_ms[(collective, step.group_size)] = max(0.0, busy - idle)
        elif step.kind == "p2p":
            message = int(options.p2p_mib * MIB)
            pipelines = pipeline_groups(world.size, step.group_size)
            ms = time_p2p(pipelines, message, world, options.repeats)
            result.p2p[step.group_size] = message / (ms * 1e-3) / 1e9
            # the per-message term the cost model charges every send (interleaving's extra ones too): as many
            # repetitions as the collectives' latency points (the median of --quick's 5 once read 2.6 ms, quiet 0.2-0.3)
            latency_repeats = Repeats(options.repeats.warmup, max(options.repeats.repetitions, LATENCY_REPETITIONS))
            small_ms = min(time_p2p(pipelines, P2P_LATENCY_BYTES, world, latency_repeats) for _ in range(P2P_BLOCKS))
            explained_ms = P2P_LATENCY_BYTES / (result.p2p[step.group_size] * 1e9) * 1e3
            result.p2p_latency_ms[step.group_size] = max(0.0, small_ms - explained_ms)
            # a send to a receiver already waiting, between compute segments: what a pipeline's hand-over costs
            busy = busy_send_ms(pipelines, world, options.repeats, options.rounds, options.busy_segment_ms)
            result.busy_send_ms[step.group_size] = busy
            result.send_extra_ms[step.group_size] = max(0.0, busy - small_ms)
        else:
            result.overlap = measure_overlap(
                world, int(options.overlap_mib * MIB), options.overlap_matmul, options.overlap_calls, options.repeats,
                options.rounds, options.concurrency_ms, options.timing_span_s,
            )  # fmt: skip
        progress.step(step.describe())
    return result


def device_name(world: World) -> str:
    if world.device.type == "cuda":
        return torch.cuda.get_device_name(world.device)
    return f"cpu ({platform.processor() or platform.machine()})"


def hardware_profile(result: SweepResult, world: World, device_memory_mib: float | None = None) -> HardwareProfile:
    """The validated HardwareProfile of a sweep (raises pydantic/SchemaError if the sweep broke a rule)."""
    cluster = ClusterSpec(
        num_nodes=world.num_nodes,
        gpus_per_node=world.size // world.num_nodes,
        device_memory_mib=device_memory_mib,
        device_name=device_name(world),
    )

    def table(kind: Collective) -> tuple[CollectiveTimes, ...]:
        entries = []
        for (collective, n), points in sorted(result.times.items(), key=lambda item: -item[0][1]):
            if collective is kind:
                sizes = sorted(points)
                entries.append(
                    CollectiveTimes(group_size=n, message_mib=tuple(sizes), time_ms=tuple(points[m] for m in sizes))
                )
        return tuple(entries)

    return HardwareProfile(
        cluster=cluster,
        backend=world.backend,
        allreduce=tuple(
            AllreduceBandwidth(group_size=n, consecutive=c, bus_bandwidth_gb_per_s=bw)
            for (n, c), bw in sorted(result.bandwidth.items(), key=lambda item: (-item[0][0], not item[0][1]))
        ),
        p2p=tuple(
            P2PBandwidth(pp=pp, bandwidth_gb_per_s=bw, latency_ms=result.p2p_latency_ms.get(pp, 0.0))
            for pp, bw in sorted(result.p2p.items())
        ),
        allreduce_time=table(Collective.ALL_REDUCE),
        all_to_all_time=table(Collective.ALL_TO_ALL),
        all_gather_time=table(Collective.ALL_GATHER),
        reduce_scatter_time=table(Collective.REDUCE_SCATTER),
        overlap_slowdown=result.overlap.slowdown if result.overlap else 1.0,
        compute_slowdown=result.overlap.concurrency_slowdown if result.overlap else 1.0,
        compute_reference_ms=(result.overlap.reference_ms or None) if result.overlap else None,
        base_memory_mib=result.base_memory_mib,
        optimizer_ms_per_million_parameters=result.optimizer_ms_per_million_parameters,
        processors_per_node=result.processors,
        call_extra=tuple(
            CallExtra(group_size=n, collective=kind.value, ms=ms)
            for (kind, n), ms in sorted(result.call_extra_ms.items(), key=lambda item: (item[0][0].value, -item[0][1]))
        )
        + tuple(CallExtra(group_size=pp, collective="p2p", ms=ms) for pp, ms in sorted(result.send_extra_ms.items())),
    )
