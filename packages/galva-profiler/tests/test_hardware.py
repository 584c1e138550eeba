"""The hardware sweep: its plan (pure), and a tiny real sweep on forked gloo ranks that every rank agrees on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from galva_comm.testing import run_distributed
from galva_profiler.collectives import Collective
from galva_profiler.hardware import (
    SweepOptions,
    group_sizes,
    hardware_profile,
    layout_groups,
    plan_sweep,
    run_sweep,
)
from galva_profiler.progress import Progress
from galva_profiler.timing import Repeats, span_ms
from galva_schema import HardwareProfile
from galva_schema.reference import read_galvatron_hardware, write_galvatron_hardware

TINY = SweepOptions(
    message_mib=(0.0625, 0.125, 0.25),
    bandwidth_mib=0.25,
    p2p_mib=0.25,
    repeats=Repeats(warmup=1, repetitions=2),
    overlap_mib=0.25,
    overlap_matmul=64,
    overlap_calls=2,
    optimizer_parameters=100_000,
    rounds=2,
    concurrency_ms=5.0,
    runtime_modules=(),  # the forked ranks hold pytest's imports already; importing the runtime would only be slow
    curve_repetitions=2,
    busy_segment_ms=0.5,
    timing_span_s=0.5,  # the concurrency test's rounds go on past rounds=2: every rank must end after the same one
)


def test_group_sizes_are_powers_of_two_up_to_the_limit() -> None:
    assert group_sizes(8) == [2, 4, 8]
    assert group_sizes(8, limit=4) == [2, 4]
    assert group_sizes(12) == [2, 4]  # 8 does not divide 12


def test_layouts_are_galva_comm_consecutive_and_strided_groups() -> None:
    assert layout_groups(8, 2, True) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout_groups(8, 2, False) == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_plan_covers_both_layouts_below_the_world_and_can_be_cut_short() -> None:
    steps = plan_sweep(8, TINY)
    bandwidth = [(s.group_size, s.consecutive) for s in steps if s.kind == "bandwidth"]
    assert bandwidth == [(2, True), (2, False), (4, True), (4, False), (8, True)]
    timed = [(s.collective, s.group_size) for s in steps if s.kind == "time"]  # one curve each, its sizes round robin
    assert sorted(timed) == sorted((c, n) for c in Collective for n in (2, 4, 8))
    # what a call costs between compute segments, beyond its curve: every collective of a group size in one step
    assert [s.group_size for s in steps if s.kind == "busy"] == [2, 4, 8]
    last_curve = max(i for i, s in enumerate(steps) if s.kind == "time")
    assert all(i > last_curve for i, s in enumerate(steps) if s.kind == "busy")  # taken beyond the curves
    assert [s.group_size for s in steps if s.kind == "p2p"] == [2, 4, 8]
    assert steps[-1].kind == "overlap"
    cut = plan_sweep(8, SweepOptions(message_mib=(1, 2), max_group_size=2, max_pp=2))
    assert {s.group_size for s in cut if s.kind != "overlap"} == {2}


def _sweep(rank: int, world_size: int) -> dict:
    import torch

    from galva_profiler.distributed import World

    world = World(rank, world_size, rank, world_size, "gloo", torch.device("cpu"))
    steps = plan_sweep(world_size, TINY)
    progress = Progress(len(steps), "test", enabled=False)
    result = run_sweep(world, steps, TINY, progress)
    # every rank at once is timed from the first rank's start to the last rank's end (rank 3 starts 0.3 s late)
    span = span_ms(100.0 + 0.1 * rank, 100.5 + 0.2 * rank, world)
    return {
        "profile": hardware_profile(result, world).to_dict(), "report": result.report(), "done": progress.done,
        "span": span,
    }  # fmt: skip


@pytest.mark.distributed
def test_tiny_sweep_on_four_ranks_gives_one_valid_profile_every_rank_agrees_on(tmp_path: Path) -> None:
    results = run_distributed(_sweep, 4, timeout=120)
    assert all(r["profile"] == results[0]["profile"] for r in results)  # max over ranks, known to all
    assert [r["span"] for r in results] == [pytest.approx(1100.0)] * 4
    profile = HardwareProfile.from_dict(results[0]["profile"])
    assert {(e.group_size, e.consecutive) for e in profile.allreduce} == {(2, True), (2, False), (4, True)}
    assert [e.pp for e in profile.p2p] == [2, 4]
    assert [e.group_size for e in profile.allreduce_time] == [4, 2]
    p = profile
    for curves in (p.all_gather_time, p.reduce_scatter_time, p.all_to_all_time):
        assert [e.message_mib for e in curves] == [(4096 / 2**20, 0.0625, 0.125, 0.25)] * 2  # + 4 KiB
    # the all-reduce's also one fp32 element per rank: the step's scalar all-reduces (the loss's totals, the clip)
    assert [e.message_mib for e in p.allreduce_time] == [(4 * n / 2**20, 4096 / 2**20, 0.0625, 0.125, 0.25)
                                                         for n in (4, 2)]
    assert profile.overlap_slowdown >= 1.0 and profile.compute_slowdown >= 1.0
    # the reference matmul on rank 0 alone, which the model profile also times (galva_profiler.reference_speed)
    assert profile.compute_reference_ms is not None and profile.compute_reference_ms > 0.0
    # a rank's process before any model: torch is imported and a step has run (hundreds of MiB resident)
    assert profile.base_memory_mib is not None and profile.base_memory_mib > 100.0
    assert results[0]["report"]["base_memory_mib"] == profile.base_memory_mib
    assert profile.optimizer_ms_per_million_parameters > 0.0
    assert all(e.latency_ms >= 0.0 for e in profile.p2p)
    # a call between compute segments: every collective and group size, at least 0 beyond the idle curve
    extras = {(e.collective, e.group_size) for e in profile.call_extra}
    assert extras == {(c.value, n) for c in Collective for n in (2, 4)} | {("p2p", pp) for pp in (2, 4)}
    assert all(e.ms >= 0.0 for e in profile.call_extra)
    # the extra is the busy time less an idle time (>= 0), at least 0: a noisy busy time may read below 0 itself
    assert all(r["ms"] <= max(r["busy_ms"], 0.0) for r in results[0]["report"]["call_extra_ms"])
    # the processors the forked CPU ranks may use (their inherited affinity): 4 ranks on fewer share them
    assert profile.processors_per_node == len(os.sched_getaffinity(0))
    assert profile.shares_processors == (len(os.sched_getaffinity(0)) < 4)
    assert [e.group_size for e in profile.all_gather_time] == [4, 2]
    assert [e.group_size for e in profile.reduce_scatter_time] == [4, 2]
    assert results[0]["done"] == len(plan_sweep(4, TINY))
    fits = results[0]["report"]["collective_time_ms"]
    assert {f["collective"] for f in fits} == {c.value for c in Collective}
    assert all(len(f["alpha_beta_fit"]["residuals"]) == (5 if f["collective"] == "all_reduce" else 4) for f in fits)
    # the reference's files round-trip through galva-schema's converters
    write_galvatron_hardware(profile, tmp_path)
    back = read_galvatron_hardware(tmp_path, num_nodes=1, gpus_per_node=4, backend="gloo")
    assert back.allreduce == profile.allreduce
    # the reference's p2p file has bandwidth only: the per-send latency does not travel
    assert [(e.pp, e.bandwidth_gb_per_s) for e in back.p2p] == [(e.pp, e.bandwidth_gb_per_s) for e in profile.p2p]
    assert sorted(os.listdir(tmp_path))[0].startswith("allreduce_bandwidth_1nodes_4gpus")


def test_the_base_imports_megatron_core_as_a_rank_does() -> None:
    """The CPU base is a rank's process before its model: megatron-core imported as galva-hp imports it in a rank
    (without torch's inductor, 42 MiB resident), in a process that had imported neither."""
    import subprocess
    import sys

    script = (
        "import sys\nfrom galva_profiler.base_memory import import_runtime\nimport_runtime()\n"
        "print('megatron.core' in sys.modules, 'torch._inductor.compile_fx' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


LATE_MS = 40.0


def _late_release(rank: int, world_size: int) -> dict[str, float | list[float]]:
    """Every collective point on 4 ranks in groups of 2, rank 3 released from each barrier LATE_MS after its
    partner; and the per-repetition reduction on made-up times."""
    import time

    import torch.distributed as dist

    from galva_comm.groups import ProcessGroupCache
    from galva_profiler import collectives
    from galva_profiler.distributed import World

    world = World(rank, world_size, rank, world_size, "gloo", torch.device("cpu"))
    groups = layout_groups(world_size, 2, True)
    cache = ProcessGroupCache(backend="gloo")
    cache.create(groups)
    plain_barrier = dist.barrier

    def late_barrier(*args: object, **kwargs: object) -> None:
        plain_barrier(*args, **kwargs)
        if rank == 3:
            time.sleep(LATE_MS / 1e3)

    collectives.dist.barrier = late_barrier  # type: ignore[assignment]
    try:
        repeats = Repeats(warmup=1, repetitions=3)
        one = collectives.time_collective(Collective.ALL_REDUCE, groups, 4096, world, cache, repeats)
        curve = collectives.time_curve(Collective.ALL_REDUCE, groups, [4096, 65536], world, cache, repeats)
    finally:
        collectives.dist.barrier = plain_barrier
    made_up = [[5.0, 1.0], [2.0, 3.0], [9.0, 9.0], [4.0, 0.5]][rank]  # groups (0, 1) and (2, 3)
    return {"one": one, "curve": curve, "made_up": collectives.from_last_arrival(made_up, groups, world)}


def test_a_collective_is_timed_from_its_groups_last_arrival() -> None:
    """A rank released late from the barrier before a call makes its partner wait: that wait is the late rank's
    (in a step, the slowest rank's work), not the call's. Timed by the slowest rank, every point read at least
    LATE_MS; timed from the last arrival, a 4 KiB all-reduce on gloo is far below it."""
    results = run_distributed(_late_release, 4, timeout=120)
    assert all(r == results[0] for r in results)  # known to every rank alike
    assert results[0]["one"] < LATE_MS / 2
    assert all(ms < LATE_MS / 2 for ms in results[0]["curve"])
    # per repetition the least time of each group, then the slowest group: min(5, 2) vs min(9, 4); min(1, 3) vs (9, .5)
    assert results[0]["made_up"] == [4.0, 1.0]


def test_a_burst_filling_one_block_of_the_busy_test_moves_nothing() -> None:
    """The busy extra is the median of its blocks' trimmed means: a slow burst of the box that fills one block of
    rounds (every round 5 ms more a call) leaves it at the quiet blocks' value, where one trimmed mean over all the
    rounds moved by a third of the burst."""
    from galva_profiler.busy_calls import BLOCKS, blocked_mean
    from galva_profiler.collectives import trimmed_mean

    quiet = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.0]
    burst = [v + 5.0 for v in quiet]
    values = quiet + burst + quiet
    assert BLOCKS == 3
    assert blocked_mean(values, len(quiet)) == pytest.approx(trimmed_mean(quiet))
    assert trimmed_mean(values) > trimmed_mean(quiet) + 1.0  # what one trimmed mean over every round gave
