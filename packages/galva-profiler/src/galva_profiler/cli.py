"""The ``galva-profile`` command: ``hardware`` (under torchrun) and ``model`` (one process).

Exit status: 0 profile written; 2 bad input, reported as one line ``galva-profile: error: ...`` before anything is
measured or written. Every file is written atomically, after all measurements, so a failed run leaves nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from galva_profiler.errors import ProfileError
from galva_schema.argparsing import OneLineParser, positive_floats

PROG = "galva-profile"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="Measure the hardware and the model for galva-search.")
    sub = parser.add_subparsers(dest="command", required=True)

    hw = sub.add_parser("hardware", help="collective bandwidths and times, p2p, overlap (run under torchrun)")
    hw.add_argument("--output", "-o", default="hardware_profile.json", help="HardwareProfile JSON to write")
    hw.add_argument("--galvatron-dir", metavar="DIR", help="also write the reference system's hardware files here")
    hw.add_argument("--report", metavar="PATH", help="write every measurement and fit (with residuals) as JSON")
    hw.add_argument("--quick", action="store_true", help="a minute-scale sweep: small messages, few repetitions")
    hw.add_argument("--sizes-mib", type=positive_floats, help="message sizes of the time sweep, MiB, e.g. 1,4,16,64")
    hw.add_argument("--bandwidth-mib", type=float, help="message size for the all-reduce bus bandwidth, MiB")
    hw.add_argument("--p2p-mib", type=float, help="message size for the p2p bandwidth, MiB")
    hw.add_argument("--max-group-size", type=int, help="cut the sweep at this group size (a big cluster)")
    hw.add_argument("--max-pp", type=int, help="largest pipeline degree whose p2p bandwidth is measured")
    hw.add_argument("--warmup", type=int, help="untimed runs before each measurement")
    hw.add_argument("--repetitions", type=int, help="timed runs per measurement (the median is kept)")
    hw.add_argument(
        "--timing-span", type=float, metavar="SECONDS",
        help="the compute slowdown's rounds go on until they span this long (default 5; 0: the repetitions only)",
    )  # fmt: skip
    hw.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl with GPUs, gloo without")
    hw.add_argument("--timeout", type=float, default=600.0, help="seconds any collective may take (default 600)")
    hw.add_argument("--device-memory-mib", type=float, help="device memory recorded in the profile (default: GPU's)")
    hw.add_argument(
        "--nproc-per-node",
        type=int,
        help="launch torchrun with this many ranks on this machine (when not already run by torchrun)",
    )
    hw.add_argument("--quiet", action="store_true", help="no progress bar")

    from galva_profiler.model_cli import add_model_arguments

    add_model_arguments(sub.add_parser("model", help="per-layer time and memory of a galva-models model"))

    from galva_profiler.check_cli import add_check_arguments

    add_check_arguments(
        sub.add_parser("check", help="run strategies for real: predicted vs measured time, memory, states, activations")
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``galva-profile``; Ctrl-C or SIGTERM end it with one line from the whole job
    (:mod:`galva_schema.interrupt`)."""
    from galva_schema.interrupt import run_command

    return run_command(PROG, lambda: _main(argv), end_process=argv is None)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "hardware":
            from galva_profiler.hardware_cli import run_hardware

            if args.nproc_per_node is not None and "RANK" not in os.environ:
                return _launch(args, list(sys.argv[1:] if argv is None else argv))
            return run_hardware(args)
        from galva_schema.stderr import quiet_transformers

        quiet_transformers()
        if args.command == "check":
            from galva_profiler.check_cli import run_check

            return run_check(args)
        from galva_profiler.model_cli import run_model

        return run_model(args)
    except ProfileError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a rank of a job: one line for the job, naming this rank
            from galva_comm.launch import rank_failed

            return rank_failed(PROG, err)
        raise


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Check the input, then run this command as ``--nproc-per-node`` ranks on this machine."""
    import torch

    from galva_comm.launch import LaunchError, launch_local
    from galva_profiler.concurrency import ALONE_THREADS_ENV
    from galva_profiler.hardware_cli import check_hardware_args

    check_hardware_args(args)
    # the threads a lone process computes with here (before the launcher gives each rank its share): the
    # compute-slowdown test times rank 0 alone with them, as the single-process model profile runs
    os.environ.setdefault(ALONE_THREADS_ENV, str(torch.get_num_threads()))
    try:
        return launch_local(args.nproc_per_node, "galva_profiler.cli", argv, prog=PROG)
    except LaunchError as err:
        raise ProfileError(str(err)) from None


if __name__ == "__main__":
    sys.exit(main())
