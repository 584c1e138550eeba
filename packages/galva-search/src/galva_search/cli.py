"""The ``galva-search`` command: profiles in, the fastest Strategy out.

Exit status: 0 a plan was written; 1 no plan fits the memory budget; 2 bad input (a missing or malformed file, a
missing profile entry, a bad option), reported on one line naming the file and key.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

# Only what the parser needs is imported here (no numpy, no pydantic): ``--help`` and a bad flag answer at once, and
# main() settles the process (_settle_process) before the search's modules load, inside run().
from galva_schema.argparsing import OneLineParser, positive_ints
from galva_schema.vocabulary import PIPELINE_TYPES, DataParallelType, PipelineSchedule, Precision
from galva_search.space import PRESETS, SP_SPACES

if TYPE_CHECKING:
    from galva_schema import Calibration, HardwareProfile
    from galva_search.cost_model import TermFactors
    from galva_search.search import SearchResult

DEFAULT_CONTEXT_MIB = 1024.0  # base memory per device when neither a run nor the hardware profile measured it
_SCHEDULES: dict[str, tuple[PipelineSchedule, ...]] = {
    **{schedule.value: (schedule,) for schedule in PipelineSchedule},
    **{name: (schedule,) for name, schedule in PIPELINE_TYPES.items()},  # the reference's names (pipedream_flush)
    # the search chooses: 1F1B, interleaved 1F1B and zb-h1 (GPipe is never faster than 1F1B and holds more)
    "auto": (PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.ZB_H1),
    "all": (
        PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.ZB_H1, PipelineSchedule.GPIPE
    ),
}


# the search-space flags named as the SpaceOptions fields they set (--disable-tp-consec sets disable_tp_consec)
_DISABLED = ("dp", "sdp", "tp", "vtp", "pp", "ckpt", "tp_consec")
_SPACE_FIELDS = ("sp_space", "max_tp", "max_pp", "max_cp", *(f"disable_{name}" for name in _DISABLED))


class _UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="galva-search",
        description="Search the fastest per-layer hybrid-parallel strategy that fits the memory budget.",
    )
    g = p.add_argument_group("profiles")
    g.add_argument("--hardware-profile", required=True, metavar="PATH",
                   help="Galva hardware profile JSON, or a directory of the reference's hardware files")
    g.add_argument("--model-profile", required=True, action="append", metavar="PATH",
                   help="Galva model profile JSON; or give it twice: reference computation file, then memory file")
    g.add_argument("--num-layers", type=positive_ints, help="reference files: layers per layer type, e.g. 32 or 24,24")
    g.add_argument("--hidden-size", type=positive_ints, help="reference files: hidden size per layer type")
    g.add_argument("--seq-length", type=positive_ints, help="reference files: sequence length per layer type")
    g.add_argument("--model-name", help="reference files: model name stored in the profile")
    g.add_argument("--time-mode", choices=("static", "batch", "sequence"), default="static",
                   help="reference files: how the computation file was profiled (default static)")
    g.add_argument("--memory-mode", choices=("static", "sequence"), default="static",
                   help="reference files: how the memory file was profiled (default static)")

    g = p.add_argument_group("cluster and budget")
    g.add_argument("--nodes", type=int, help="nodes (default: the hardware profile's)")
    g.add_argument("--gpus-per-node", type=int, help="devices per node (default: the hardware profile's)")
    g.add_argument("--memory", help="memory budget per device: 36GB (1e9 B), 36GiB (2^30 B) or 36000MiB "
                   "(default: the hardware profile's device memory)")
    g.add_argument("--memory-reserve", help="memory kept free for allocator fragmentation, e.g. 4GiB or 0 "
                   "(default: 5%% of the budget; transients are terms of the memory model)")
    g.add_argument("--context-memory", help="base memory per device before any model, e.g. 400MiB (default: the "
                   "--calibration's measured base, else the hardware profile's, else 1024MiB)")

    g = p.add_argument_group("batch")
    g.add_argument("--global-batch-size", type=int, help="fix the global batch size")
    g.add_argument("--min-batch-size", type=int, default=8)
    g.add_argument("--max-batch-size", type=int, default=512)
    g.add_argument("--batch-size-scale", type=int, default=8, help="step between searched batch sizes")
    g.add_argument("--num-micro-batches", type=int, help="fix the number of micro-batches")

    g = p.add_argument_group("search space")
    g.add_argument("--search-space", choices=PRESETS, default="full")
    g.add_argument("--sp-space", choices=SP_SPACES, default="tp",
                   help="tp: Megatron tp; sp: Ulysses; tp+sp: either, per layer (default tp)")
    for name in _DISABLED:
        g.add_argument(_flag(f"disable_{name}"), action="store_true")
    g.add_argument("--max-tp", type=int, default=8)
    g.add_argument("--max-pp", type=int, default=8)
    g.add_argument("--max-cp", type=int, default=1,
                   help="largest context-parallel degree (ring attention) per layer and for the vocabulary, with "
                   "tp and Ulysses alike; a power of two (default 1: none)")
    g.add_argument("--pipeline-schedule", choices=sorted(_SCHEDULES), default="1f1b",
                   help="pipeline schedule of plans with pp > 1: 1f1b (= pipedream_flush, the reference's), gpipe, "
                   "interleaved-1f1b (--virtual-stages model chunks per stage), zb-h1 (zero-bubble H1); auto: the "
                   "search chooses among 1f1b, interleaved-1f1b and zb-h1; all: gpipe too (default 1f1b)")
    g.add_argument("--virtual-stages", type=positive_ints, default=[2, 4], metavar="V[,V...]",
                   help="model chunks per stage tried with interleaved-1f1b, each >= 2 (default 2,4)")
    g.add_argument("--default-dp-type", choices=[t.value for t in DataParallelType], default="ddp")
    g.add_argument("--mixed-precision", choices=[pr.value for pr in Precision],
                   help="default: the model profile's precision")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--fine-grained", dest="fine_grained", action="store_true", default=True,
                      help="a strategy per layer (default)")
    mode.add_argument("--global-strategy", dest="fine_grained", action="store_false",
                      help="one strategy for every layer")
    sp = g.add_mutually_exclusive_group()
    sp.add_argument("--megatron-sp", dest="megatron_sp", action="store_true", default=None,
                    help="search with Megatron-SP (default: as the model profile was measured; a reference memory "
                    "file with both plain and _sp sections is read without it, as the reference's search does)")
    sp.add_argument("--no-megatron-sp", dest="megatron_sp", action="store_false")
    g.add_argument("--backward-coefficient", type=float, default=2.0, help="backward time / forward time")
    g.add_argument("--state-accounting", choices=["galva-hp", "reference"], default="galva-hp",
                   help="model-state bytes per parameter: what galva-hp holds (bf16: 2 + 4 fp32 gradient + 12, "
                        "FSDP2's peaks; default) or the reference's formulas (bf16 2 + 2 + 12), to reproduce its plans")
    g.add_argument("--calibration", metavar="PATH",
                   help="a galva_schema Calibration (galva-profile check --calibration-output): per-term factors")

    g = p.add_argument_group("output")
    g.add_argument("--output", metavar="PATH", help="write the Strategy JSON here")
    g.add_argument("--summary-json", metavar="PATH", help="write predicted time, throughput, memory per stage")
    g.add_argument("--galvatron-output", metavar="PATH", help="also write the reference's strategy format")
    g.add_argument("--log", metavar="PATH", help="write one line per task tried")
    g.add_argument("--report-html", metavar="PATH",
                   help="write a self-contained HTML report: memory and time per stage, layer map, search counts")
    g.add_argument("--threads", type=int, default=0, help="DP threads (default 0: all cores)")
    g.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _progress(quiet: bool) -> Callable[[str], None] | None:
    if quiet:
        return None
    state = {"last": 0.0}
    tty = sys.stderr.isatty()

    def show(message: str) -> None:
        now = time.monotonic()
        if now - state["last"] < 0.2:
            return
        state["last"] = now
        sys.stderr.write(("\r" + message + "\033[K") if tty else message + "\n")
        sys.stderr.flush()

    return show


def _factors(calibration: Calibration | None) -> TermFactors:
    """The calibration's per-term factors (1.0 everywhere without one)."""
    from galva_search.cost_model import TermFactors

    return TermFactors() if calibration is None else TermFactors.from_calibration(calibration)


def _context_mib(flag: str | None, calibration: Calibration | None, hardware: HardwareProfile) -> float:
    """Base memory per device: the flag, else what a run measured (calibration), else what the hardware profile
    measured, else the guess older profiles were searched with."""
    from galva_search.profiles import parse_memory

    if flag is not None:
        return parse_memory(flag, allow_zero=True)
    for measured in (calibration.base_memory_mib if calibration else None, hardware.base_memory_mib):
        if measured is not None:
            return measured
    return DEFAULT_CONTEXT_MIB


_RANGES: dict[str, tuple[float, bool]] = {
    # flag: (minimum, whether the minimum itself is allowed)
    "nodes": (1, True), "gpus_per_node": (1, True), "global_batch_size": (1, True), "min_batch_size": (1, True),
    "max_batch_size": (1, True), "batch_size_scale": (1, True), "num_micro_batches": (1, True), "max_tp": (1, True),
    "max_pp": (1, True), "max_cp": (1, True), "backward_coefficient": (0, False), "threads": (0, True),
}  # fmt: skip
_BATCH_FLAGS = ("global_batch_size", "min_batch_size", "max_batch_size", "num_micro_batches")
_OUTPUTS = ("output", "summary_json", "galvatron_output", "log", "report_html")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_arguments(args: argparse.Namespace) -> None:
    """Every numeric flag in its range and every output writable, before any profile is read (exit 2, not 1)."""
    import math

    from galva_schema.strategy import MAX_BATCH_SIZE

    for dest, (low, inclusive) in _RANGES.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise _UsageError(f"{_flag(dest)} must be a finite number, got {value}")
        if value < low or (value == low and not inclusive):
            raise _UsageError(f"{_flag(dest)} must be {'>=' if inclusive else '>'} {low:g}, got {value:g}")
    for dest in _BATCH_FLAGS:  # before the search spins over the divisors of an absurd batch
        value = getattr(args, dest)
        if value is not None and value > MAX_BATCH_SIZE:
            raise _UsageError(
                f"{_flag(dest)} must be <= {MAX_BATCH_SIZE} (2**31 - 1, galva_schema.MAX_BATCH_SIZE; no real job "
                f"comes near it), got {value}"
            )
    if args.galvatron_output and not set(_SCHEDULES[args.pipeline_schedule]) <= set(PIPELINE_TYPES.values()):
        raise _UsageError(
            f"--galvatron-output: the reference's strategy format holds "
            f"{' and '.join(schedule.value for schedule in PIPELINE_TYPES.values())} plans only; "
            f"--pipeline-schedule {args.pipeline_schedule} may choose another schedule"
        )
    from galva_schema.files import output_problem

    seen: dict[str, str] = {}
    for dest in _OUTPUTS:
        path = getattr(args, dest)
        if path is None:
            continue
        problem = output_problem(path)
        if problem is not None:
            raise _UsageError(f"{_flag(dest)} {path}: {problem}")
        key = os.path.abspath(path)
        if key in seen:
            raise _UsageError(f"{_flag(dest)} {path} is also the {seen[key]} file; use another name")
        seen[key] = _flag(dest)


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    from galva_search.cost_model import CostModel, CostSettings
    from galva_search.profiles import load_hardware, load_model, parse_memory
    from galva_search.search import SearchOptions, batch_size_range, search
    from galva_search.space import SpaceOptions
    from galva_search.summary import text_summary

    hardware = load_hardware(args.hardware_profile, num_nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    cluster = hardware.cluster
    if (args.nodes is not None and args.nodes != cluster.num_nodes) or (
        args.gpus_per_node is not None and args.gpus_per_node != cluster.gpus_per_node
    ):
        raise _UsageError(
            f"{args.hardware_profile}: cluster: the profile describes {cluster.num_nodes} x {cluster.gpus_per_node} "
            f"devices, not {args.nodes or cluster.num_nodes} x {args.gpus_per_node or cluster.gpus_per_node}"
        )
    model = load_model(
        args.model_profile,
        num_layers=args.num_layers,
        hidden_sizes=args.hidden_size,
        seq_lengths=args.seq_length,
        model_name=args.model_name,
        time_mode=args.time_mode,
        memory_mode=args.memory_mode,
        megatron_sp=args.megatron_sp,
    )
    model_source = args.model_profile[-1]
    megatron_sp = model.megatron_sp if args.megatron_sp is None else args.megatron_sp
    if megatron_sp != model.megatron_sp:
        measured = "with" if model.megatron_sp else "without"
        raise _UsageError(
            f"{model_source}: megatron_sp: the activations were profiled {measured} Megatron-SP; search with the "
            f"same setting or profile again"
        )
    if args.memory is not None:
        budget = parse_memory(args.memory)
    elif cluster.device_memory_mib:
        budget = float(cluster.device_memory_mib)
    else:
        raise _UsageError("--memory is required: the hardware profile does not record the device memory")
    reserve = None if args.memory_reserve is None else parse_memory(args.memory_reserve, allow_zero=True)
    if args.global_batch_size is not None:
        if args.global_batch_size < 1:
            raise _UsageError("--global-batch-size must be >= 1")
        batches = [args.global_batch_size]
    else:
        batches = batch_size_range(args.min_batch_size, args.max_batch_size, args.batch_size_scale)
        if not batches:
            raise _UsageError(
                f"no batch size between --min-batch-size {args.min_batch_size} and --max-batch-size "
                f"{args.max_batch_size} in steps of {args.batch_size_scale}"
            )
    if args.num_micro_batches is not None and args.num_micro_batches < 1:
        raise _UsageError("--num-micro-batches must be >= 1")
    if any(v < 2 for v in args.virtual_stages):
        raise _UsageError(f"--virtual-stages: every value must be >= 2 (1 is plain 1f1b), got {args.virtual_stages}")
    default_dp = DataParallelType(args.default_dp_type)
    space = SpaceOptions(
        preset=args.search_space,
        default_dp_type=default_dp,
        **{name: getattr(args, name) for name in _SPACE_FIELDS},
    )
    calibration = None
    if args.calibration:
        from galva_schema import Calibration  # only here: a search without one never builds its models

        calibration = Calibration.load(args.calibration)
    settings = CostSettings(
        precision=Precision(args.mixed_precision) if args.mixed_precision else model.precision,
        backward_coefficient=args.backward_coefficient,
        pipeline_schedule=_SCHEDULES[args.pipeline_schedule][0],
        default_dp_type=default_dp,
        megatron_sp=megatron_sp,
        context_mib=_context_mib(args.context_memory, calibration, hardware),
        state_accounting=args.state_accounting,
        factors=_factors(calibration),
    )
    cost = CostModel(hardware, model, settings, hardware_source=str(args.hardware_profile), model_source=model_source)
    options = SearchOptions(
        memory_budget_mib=budget,
        batch_sizes=tuple(batches),
        space=space,
        num_micro_batches=args.num_micro_batches,
        fine_grained=args.fine_grained,
        memory_reserve_mib=reserve,
        threads=args.threads,
        schedules=_SCHEDULES[args.pipeline_schedule],
        virtual_stages=tuple(args.virtual_stages),
    )
    progress = _progress(args.quiet)
    try:
        result = search(cost, options, progress=progress)
    finally:
        if progress is not None and sys.stderr.isatty():
            sys.stderr.write("\n")
    try:
        _write_outputs(args, result)
    except OSError as err:  # checked before the search; a disk that filled up since is still an output error
        raise _UsageError(f"cannot write {err.filename or 'an output'}: {err.strerror or err}") from None
    print(text_summary(result.strategy, result.summary))
    return 0


def _write_outputs(args: argparse.Namespace, result: SearchResult) -> None:
    from galva_schema.files import write_json_atomic, write_text_atomic

    if args.log:
        write_text_atomic(args.log, "".join(record.line() + "\n" for record in result.log))
    if args.output:
        result.strategy.save(args.output)
    if args.galvatron_output:
        from galva_schema.reference import to_galvatron_strategy

        write_json_atomic(args.galvatron_output, to_galvatron_strategy(result.strategy))
    if args.summary_json:
        result.summary.save(args.summary_json)
    if args.report_html:
        from galva_search.report import write_html_report  # only here: the page's modules are a tenth of start-up

        write_html_report(args.report_html, result)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``galva-search``; Ctrl-C or SIGTERM end it with one line (:mod:`galva_schema.interrupt`).
    ``argv`` None: this is the command's own process (:func:`_settle_process`)."""
    if argv is None:
        _settle_process()
    from galva_schema.interrupt import run_command

    status = run_command("galva-search", lambda: _main(argv), end_process=argv is None)
    if argv is None:
        _end_process(status)
    return status


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from galva_schema.errors import SchemaError
    from galva_search.options import NoFeasibleStrategy

    try:
        return run(args)
    except NoFeasibleStrategy as err:
        print(f"galva-search: {err}", file=sys.stderr)
        return 1
    except (SchemaError, ValueError, _UsageError) as err:
        print(f"galva-search: error: {err}", file=sys.stderr)
        return 2


def _settle_process() -> None:
    """Settings for the command's own short-lived process, taken before numpy and pydantic load (a user's own setting
    of either variable wins): no pydantic plugins (their lookup reads every installed package's metadata; Galva
    defines none), numpy's BLAS without worker threads (the search multiplies no matrices; its DP threads are its
    own), and no cyclic garbage collection (the process ends after one search: its ~100 passes cost ~5% of the
    command's CPU, and the peak memory is the same without them; benchmarks/search/README.md)."""
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if os.environ["PYDANTIC_DISABLE_PLUGINS"] in ("__all__", "1", "true"):
        _no_plugin_lookup()
    import gc

    gc.disable()


def _no_plugin_lookup() -> None:
    """pydantic's plugin loader (``pydantic.plugin._loader``, imported when the first validator is built) imports
    ``importlib.metadata`` at its top, and with it email, zipfile, csv and socket (~0.03-0.05 s, 4% of the command),
    only to look up plugins, which the variable switches off (its ``get_plugins`` then answers "none"). The command
    gives pydantic a loader that answers the same without those imports, unless the real one is already loaded."""
    import types

    name = "pydantic.plugin._loader"
    if name not in sys.modules:
        loader = types.ModuleType(name, "galva-search: pydantic plugins are disabled in this process (none to load)")
        loader.get_plugins = lambda: ()  # type: ignore[attr-defined]
        sys.modules[name] = loader


def _end_process(status: int) -> NoReturn:
    """End the command's process with ``status`` once its output is flushed, without the interpreter's finalization
    (a last full collection and every module torn down: ~0.1 s of CPU with numpy and pydantic loaded, a tenth of the
    command). Its outputs are already whole (written to a temporary name, then renamed); nothing else is pending."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # the output went away (a closed pipe): what Python's own shutdown would end with
        os._exit(120)
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
