"""``galva-profile check``: flags, input checks (one-line errors before anything runs), outputs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from galva_profiler.errors import ProfileError
from galva_profiler.outputs import check_writable_file, writing

if TYPE_CHECKING:
    from galva_profiler.model_source import MetaModel
    from galva_schema import HardwareProfile, ModelProfile, Strategy


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware-profile", required=True, metavar="PATH", help="galva HardwareProfile JSON")
    p.add_argument("--model-profile", required=True, metavar="PATH", help="galva ModelProfile JSON")
    p.add_argument("--model", "--preset", dest="preset", metavar="PRESET", help="galva-models preset of the model")
    p.add_argument("--model-config", metavar="DIR", help="Hugging Face config or checkpoint directory instead")
    p.add_argument(
        "--strategy",
        action="append",
        default=[],
        metavar="PATH",
        help="a Strategy JSON file or a directory of them (repeatable)",
    )
    p.add_argument("--search", action="store_true", help="also check the plan galva-search picks on these profiles")
    p.add_argument(
        "--top",
        type=int,
        default=0,
        metavar="N",
        help="also check the N fastest distinct plans galva-search ranks on these profiles",
    )
    p.add_argument("--memory", default="4GiB", help="--search/--top: memory budget per device (default 4GiB)")
    p.add_argument("--global-batch-size", type=int, default=4, help="--search/--top: global batch size (default 4)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per strategy (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument(
        "--timing-span", type=float, default=0.0, metavar="SECONDS",
        help="timed steps go on past --steps until they span this long (default 0): on a shared machine a few steps "
        "can fall in one burst of a slower processor",
    )  # fmt: skip
    p.add_argument("--backward-coefficient", type=float, default=2.0, help="as galva-search's (default 2)")
    p.add_argument("--output", "-o", default="check.json", help="JSON report (rows, raw measurements)")
    p.add_argument("--table", metavar="PATH", help="also write the table as Markdown")
    p.add_argument("--calibration-output", metavar="PATH", help="write the fitted Calibration here")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one strategy may take (default 600)")


def _strategies(paths: list[str]) -> list[tuple[str, Path]]:
    out = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            files = sorted(path.glob("*.json"))
            if not files:
                raise ProfileError(f"--strategy {path}: no *.json files in this directory")
            out += [(f.stem, f) for f in files]
        elif path.is_file():
            out.append((path.stem, path))
        else:
            raise ProfileError(f"--strategy {path}: no such file or directory")
    return out


def run_check(args: argparse.Namespace) -> int:
    from galva_comm.testing import DistributedTestError
    from galva_profiler.check import CheckOptions, StrategyCheck, compare, measure, report, table
    from galva_profiler.model_source import load_config
    from galva_schema import HardwareProfile, ModelProfile, SchemaError, Strategy, plan_problems

    if args.steps < 1 or args.warmup < 0 or args.timing_span < 0:
        raise ProfileError("--steps must be >= 1, --warmup and --timing-span >= 0")
    if args.top < 0:
        raise ProfileError("--top must be >= 1")
    if not args.strategy and not args.search and not args.top:
        raise ProfileError("nothing to check: give --strategy PATH (a file or a directory), --search or --top N")
    outputs = [(args.output, "--output"), (args.table, "--table"), (args.calibration_output, "--calibration-output")]
    for path, flag in outputs:
        if path:
            check_writable_file(path, flag)
    config, _ = load_config(args.preset, args.model_config)
    paths = _strategies(args.strategy)
    try:
        hardware = HardwareProfile.load(args.hardware_profile)
        model = ModelProfile.load(args.model_profile)
        named = [(name, Strategy.load(path)) for name, path in paths]
    except SchemaError as err:
        raise ProfileError(str(err)) from None
    seq = model.layer_types[0].seq_length
    meta = _check_same_model(config, args, model)
    options = CheckOptions(
        args.steps, args.warmup, seq, timeout_s=args.timeout, backward_coefficient=args.backward_coefficient,
        decoder_seq_length=meta.decoder_length(seq), span_s=args.timing_span,
    )  # fmt: skip
    if args.top:
        top = _top(hardware, model, args)
        named += [(f"galva-search-top{i + 1}", strategy) for i, strategy in enumerate(top)]
        if args.search:  # the first of the top N is galva-search's plan
            named.append(("galva-search", top[0]))
    elif args.search:
        named.append(("galva-search", _searched(hardware, model, args)))
    constraints = model.constraints
    for name, strategy in named:
        if strategy.world_size != hardware.cluster.world_size:
            raise ProfileError(
                f"{name}: world_size {strategy.world_size}, the hardware profile has "
                f"{hardware.cluster.world_size} ranks"
            )
        if strategy.num_layers != model.num_layers:
            raise ProfileError(f"{name}: {strategy.num_layers} layers, the model has {model.num_layers}")
        problems = plan_problems(strategy, constraints, seq_len=seq) if constraints else []
        if problems:
            raise ProfileError(f"{name}: {problems[0]}")
    checks = []
    for i, (name, strategy) in enumerate(named):
        print(f"[{i + 1}/{len(named)}] {name}: {strategy.world_size} ranks", file=sys.stderr, flush=True)
        check = StrategyCheck(name, strategy)
        try:
            check.ranks = measure(config, strategy, options)
        except DistributedTestError as err:  # a rank raised, or hung: one line naming it, no traceback
            raise ProfileError(f"{name}: {err.summary}") from None
        compare(check, hardware, model, options)
        checks.append(check)
    calibration = None
    if args.calibration_output:
        from galva_profiler.calibration import fit_calibration

        calibration = fit_calibration(checks, hardware, model, options)
    text = table([row for check in checks for row in check.rows])
    write_outputs(args, report(checks, calibration), text, calibration)
    print(text)
    return 0


def write_outputs(args: argparse.Namespace, data: dict[str, Any], text: str, calibration: Any) -> None:
    """Write the report (``--output``, last: its presence means the whole check succeeded), the ``--table`` and the
    ``--calibration-output``. A write that fails (a disk that filled up during the runs) is one line, and the files
    this call already wrote are removed again: all of them or none."""
    from galva_schema import write_json_atomic, write_text_atomic

    writes = []
    if args.table:
        writes.append(("--table", args.table, lambda: write_text_atomic(args.table, text)))
    if calibration is not None:
        writes.append(("--calibration-output", args.calibration_output,
                       lambda: calibration.save(args.calibration_output)))  # fmt: skip
    writes.append(("--output", args.output, lambda: write_json_atomic(args.output, data)))
    written: list[Path] = []
    try:
        for flag, path, write in writes:
            with writing(flag, path):
                write()
            written.append(Path(path))
    except ProfileError:
        for path in written:
            path.unlink(missing_ok=True)
        raise


def _check_same_model(config: Any, args: argparse.Namespace, profile: ModelProfile) -> MetaModel:
    """The model profile must describe the model the check trains: per layer type the count, hidden size and
    parameters of one layer (0.1%: the same layer counted by another tool), and the vocabulary. Otherwise one model's
    predictions would be compared with another's measurements, silently. Layer type names are labels (a profile
    converted from reference files has its own), so they are shown, not compared. Returns the model (on the meta
    device) at the profile's lengths."""
    from galva_profiler.model_profile import layer_specs
    from galva_profiler.model_source import MetaModel

    meta = MetaModel.of_profile(config, profile)  # on the meta device: no weights
    specs = layer_specs(meta, profile.layer_types[0].seq_length)
    built = [
        (kind, count, specs[first].hidden_size, sum(p.numel() for p in meta.layered.layers[first].parameters()) * 4)
        for kind, first, count in meta.layer_runs()
    ]
    profiled = [(t.name, t.num_layers, t.hidden_size, t.parameter_mib * 2**20) for t in profile.layer_types]
    same = len(built) == len(profiled) and all(
        b[1:3] == p[1:3] and abs(b[3] - p[3]) <= 1e-3 * max(b[3], p[3]) for b, p in zip(built, profiled)
    )
    flag = f"--model {args.preset}" if args.preset else f"--model-config {args.model_config}"
    if not same:
        raise ProfileError(
            f"--model-profile {args.model_profile}: profiles {profile.model_name!r} with {_layers(profiled)}, but "
            f"{flag} has {_layers(built)}: give the profile of the model being checked"
        )
    vocab = getattr(config, "vocab_size", None)
    if profile.vocab.vocab_size is not None and vocab is not None and profile.vocab.vocab_size != vocab:
        raise ProfileError(
            f"--model-profile {args.model_profile}: profiles {profile.model_name!r} with a vocabulary of "
            f"{profile.vocab.vocab_size}, but {flag} has {vocab}: give the profile of the model being checked"
        )
    return meta


def _layers(types: list[tuple[str, int, int, float]]) -> str:
    return ", ".join(
        f"{count} {kind} layers of hidden size {hidden} ({size / 2**20:.4g} MiB of fp32 parameters each)"
        for kind, count, hidden, size in types
    )


def _searched(hardware: HardwareProfile, model: ModelProfile, args: argparse.Namespace) -> Strategy:
    from galva_search.cost_model import CostModel, CostSettings
    from galva_search.profiles import parse_memory
    from galva_search.search import NoFeasibleStrategy, SearchOptions, search

    settings = CostSettings(precision=model.precision, backward_coefficient=args.backward_coefficient)
    cost = CostModel(hardware, model, settings)
    try:
        budget = parse_memory(args.memory)
        return search(cost, SearchOptions(memory_budget_mib=budget, batch_sizes=(args.global_batch_size,))).strategy
    except (NoFeasibleStrategy, ValueError) as err:
        raise ProfileError(f"--search: {err}") from None


def _top(hardware: HardwareProfile, model: ModelProfile, args: argparse.Namespace) -> list[Strategy]:
    from galva_search.cost_model import CostModel, CostSettings
    from galva_search.profiles import parse_memory
    from galva_search.search import NoFeasibleStrategy, SearchOptions
    from galva_search.top import top_plans

    settings = CostSettings(precision=model.precision, backward_coefficient=args.backward_coefficient)
    cost = CostModel(hardware, model, settings)
    try:
        budget = parse_memory(args.memory)
        options = SearchOptions(memory_budget_mib=budget, batch_sizes=(args.global_batch_size,))
        return [plan.strategy for plan in top_plans(cost, options, args.top)]
    except (NoFeasibleStrategy, ValueError) as err:
        raise ProfileError(f"--top: {err}") from None
