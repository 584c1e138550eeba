"""``galva-profile hardware``: flags -> sweep -> HardwareProfile (+ reference files, + report), on every rank."""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from galva_profiler.distributed import World, all_agree, init_world
from galva_profiler.errors import ProfileError
from galva_profiler.hardware import QUICK, SweepOptions, SweepResult, hardware_profile, plan_sweep, run_sweep
from galva_profiler.outputs import check_writable_dir, check_writable_file, writing
from galva_profiler.progress import Progress
from galva_profiler.timing import Repeats
from galva_schema import HardwareProfile, write_json_atomic


def sweep_options(args: argparse.Namespace) -> SweepOptions:
    """The sweep the flags describe (``--quick`` first, then every explicit flag on top)."""
    base = QUICK if args.quick else SweepOptions()
    changes: dict[str, object] = {}
    if args.sizes_mib is not None:
        changes["message_mib"] = tuple(sorted(set(args.sizes_mib)))
    for flag in ("bandwidth_mib", "p2p_mib", "max_group_size", "max_pp"):
        if getattr(args, flag) is not None:
            changes[flag] = getattr(args, flag)
    if args.timing_span is not None:
        changes["timing_span_s"] = args.timing_span
    if args.repetitions is not None:  # the rounds of the overlap, concurrency and optimizer tests too
        changes["rounds"] = args.repetitions
    if args.warmup is not None or args.repetitions is not None:
        changes["repeats"] = Repeats(
            warmup=base.repeats.warmup if args.warmup is None else args.warmup,
            repetitions=base.repeats.repetitions if args.repetitions is None else args.repetitions,
        )
    try:
        return dataclasses.replace(base, **changes)  # type: ignore[arg-type]
    except ValueError as err:
        raise ProfileError(str(err)) from None


def check_hardware_args(args: argparse.Namespace) -> SweepOptions:
    """Everything that can be checked before joining the job: flags and output paths."""
    for flag in ("max_group_size", "max_pp"):
        value = getattr(args, flag)
        if value is not None and value < 2:
            raise ProfileError(f"--{flag.replace('_', '-')} {value}: must be at least 2")
    if args.timeout <= 0:
        raise ProfileError(f"--timeout {args.timeout}: must be positive")
    options = sweep_options(args)
    check_writable_file(args.output, "--output")
    if args.report:
        check_writable_file(args.report, "--report")
    if args.galvatron_dir:
        check_writable_dir(args.galvatron_dir, "--galvatron-dir")
    return options


def run_hardware(args: argparse.Namespace) -> int:
    """Measure and write; every rank runs this, rank 0 prints and writes."""
    if "RANK" not in os.environ:  # checked before the flags: a run without a launcher says so first
        init_world(args.timeout, args.backend)
    options = check_hardware_args(args)
    world = init_world(args.timeout, args.backend)
    lead = world.rank == 0
    steps = plan_sweep(world.size, options)
    progress = Progress(len(steps), f"hardware ({world.size} ranks, {world.backend})", enabled=lead and not args.quiet)
    result = run_sweep(world, steps, options, progress)
    memory = args.device_memory_mib
    if memory is None and world.device.type == "cuda":
        memory = torch.cuda.get_device_properties(world.device).total_memory / 2**20
    profile = hardware_profile(result, world, memory)
    written = all_agree(True, world.device)  # every rank is done measuring before rank 0 writes
    if lead and written:
        _write(args, profile, result)
        print(summary(profile, result, world))
    torch.distributed.destroy_process_group()
    return 0


def _write(args: argparse.Namespace, profile: HardwareProfile, result: SweepResult) -> None:
    if args.report:
        with writing("--report", args.report):
            write_json_atomic(args.report, result.report())
    if args.galvatron_dir:
        from galva_schema.reference import write_galvatron_hardware

        with writing("--galvatron-dir", args.galvatron_dir):
            write_galvatron_hardware(profile, args.galvatron_dir)
    with writing("--output", args.output):
        profile.save(args.output)  # last: its presence means the whole run succeeded


def summary(profile: HardwareProfile, result: SweepResult, world: World) -> str:
    """A short text summary: bandwidths, fits with residuals, p2p, overlap."""
    lines = [f"hardware profile: {world.size} ranks on {world.num_nodes} node(s), backend {world.backend}"]
    for entry in profile.allreduce:
        layout = "consecutive" if entry.consecutive else "strided"
        lines.append(
            f"  all_reduce n={entry.group_size} {layout:11s} bus bandwidth {entry.bus_bandwidth_gb_per_s:.3f} GB/s"
        )
    for kind, n in sorted(result.times, key=lambda key: (key[0].value, key[1])):
        fit = result.fit(kind, n)
        beta, alpha = fit.coefficients
        lines.append(
            f"  {kind.value:14s} n={n}: {alpha:.3f} ms + {beta:.3f} ms/MiB "
            f"(max residual {100 * fit.max_relative_residual:.1f}%)"
        )
    for p2p in profile.p2p:
        lines.append(f"  p2p pp={p2p.pp}: {p2p.bandwidth_gb_per_s:.3f} GB/s, latency {p2p.latency_ms:.3f} ms per send")
    if result.overlap:
        o = result.overlap
        lines.append(
            f"  overlap: compute x{o.compute_slowdown:.3f}, communication x{o.comm_slowdown:.3f} "
            f"-> overlap_slowdown {o.slowdown:.3f}; every rank computing at once x{o.concurrency_slowdown:.3f} "
            f"-> compute_slowdown"
        )
    return "\n".join(lines)
