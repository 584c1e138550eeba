"""``galva-profile model``: flags -> model sweep -> one ModelProfile per sequence length (+ reference files, report)."""

from __future__ import annotations

import argparse
from pathlib import Path

from galva_profiler.errors import ProfileError
from galva_profiler.outputs import check_writable_dir, check_writable_file, writing
from galva_profiler.timing import TIMING_SPAN_S, Repeats
from galva_schema import ModelProfile, Precision, write_json_atomic
from galva_schema.argparsing import positive_ints

DEFAULT_OUTPUT = "{model}_seq{seq}.model_profile.json"
REPETITIONS = 7
"""Timed passes per batch size, --quick too: interleaved, they cost a few seconds on a small model, and 3 let one
disturbed pass in two move a point of the fit."""


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("model")
    src.add_argument(
        "--model", "--preset", dest="preset", metavar="PRESET",
        help="a galva-models preset, as galva-train --model takes it (tiny-llama, llama2-7b, tiny-<model_type>)",
    )  # fmt: skip
    src.add_argument("--model-config", metavar="DIR", help="a Hugging Face config or checkpoint directory")
    src.add_argument(
        "--seq-lengths", type=positive_ints, required=True,
        help="comma-separated, e.g. 128 or 128,256,512 (an encoder-decoder's: the encoder's)",
    )  # fmt: skip
    src.add_argument(
        "--decoder-seq-length", type=int, metavar="N",
        help="encoder-decoder models: the decoder's length at every profiled length (default: the encoder's)",
    )  # fmt: skip
    sweep = p.add_argument_group("sweep")
    sweep.add_argument("--batch-sizes", type=positive_ints, help="comma-separated (default 1,2,4,8; --quick 1,2)")
    sweep.add_argument("--max-tp", type=int, default=8, help="largest tp / Ulysses / vocab tp degree measured")
    sweep.add_argument("--precision", choices=[x.value for x in Precision], default="fp32")
    sweep.add_argument("--megatron-sp", action="store_true", help="profile activations with Megatron-SP")
    sweep.add_argument("--time-form", choices=("static", "batch", "sequence"), default="batch")
    sweep.add_argument("--warmup", type=int, help="untimed passes (default 2)")
    sweep.add_argument(
        "--repetitions", type=int, help="timed passes, round robin over the batch sizes; the median is kept (default 7)"
    )
    sweep.add_argument(
        "--timing-span", type=float, default=TIMING_SPAN_S, metavar="SECONDS",
        help=f"a layer's timed passes go on until they span this long (default {TIMING_SPAN_S:g}; 0: the repetitions "
        "only): their median reads the machine's usual speed, not one burst's",
    )  # fmt: skip
    sweep.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="where the layers are timed (default auto: the GPU where there is one, as the job trains there; "
        "activation bytes are measured on CPU either way)",
    )  # fmt: skip
    sweep.add_argument("--quick", action="store_true", help="few batch sizes (1,2)")
    sweep.add_argument("--timeout", type=float, default=300.0, help="seconds the forked tp ranks may take")
    out = p.add_argument_group("output")
    out.add_argument(
        "--output",
        "-o",
        default=DEFAULT_OUTPUT,
        help=f"ModelProfile JSON, {{model}}/{{seq}} filled in ({DEFAULT_OUTPUT})",
    )
    out.add_argument("--galvatron-dir", metavar="DIR", help="also write the reference's computation/memory files")
    out.add_argument("--report", metavar="PATH", help="write every measurement and fit (with residuals) as JSON")
    out.add_argument("--quiet", action="store_true", help="no progress bar")


def output_paths(template: str, model: str, seqs: list[int]) -> dict[int, Path]:
    """The profile path of every sequence length; several lengths need ``{seq}`` in the template."""
    if len(seqs) > 1 and "{seq}" not in template:
        raise ProfileError(f"--output {template}: several sequence lengths need {{seq}} in the file name")
    try:
        return {seq: Path(template.format(model=model, seq=seq)) for seq in seqs}
    except (KeyError, IndexError, ValueError) as err:
        raise ProfileError(f"--output {template}: only {{model}} and {{seq}} may be filled in ({err})") from None


def _device(choice: str) -> str:
    """``--device``: auto is CUDA where torch sees a GPU, else CPU; cuda without one is an error."""
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ProfileError("--device cuda: torch sees no CUDA device here (use --device cpu or auto)")
    return choice


def run_model(args: argparse.Namespace) -> int:
    from galva_profiler.model_profile import ModelSweepOptions, model_profiles, run_model_sweep
    from galva_profiler.model_report import sweep_report
    from galva_profiler.model_source import MetaModel, load_config

    config, name = load_config(args.preset, args.model_config)
    seqs = sorted(set(args.seq_lengths))
    paths = output_paths(args.output, name, seqs)
    for path in paths.values():
        check_writable_file(path, "--output")
    if args.report:
        check_writable_file(args.report, "--report")
    if args.galvatron_dir:
        check_writable_dir(args.galvatron_dir, "--galvatron-dir")
    batches = args.batch_sizes or ([1, 2] if args.quick else [1, 2, 4, 8])
    repeats = Repeats(
        warmup=args.warmup if args.warmup is not None else 2,
        repetitions=args.repetitions if args.repetitions is not None else REPETITIONS,
    )
    options = ModelSweepOptions(
        seq_lengths=tuple(seqs),
        batch_sizes=tuple(batches),
        max_tp=args.max_tp,
        precision=Precision(args.precision),
        megatron_sp=args.megatron_sp,
        time_form=args.time_form,
        repeats=repeats,
        timeout_s=args.timeout,
        timing_span_s=args.timing_span,
        device=_device(args.device),
    )
    if args.decoder_seq_length is not None and args.decoder_seq_length < 2:
        raise ProfileError(f"--decoder-seq-length must be >= 2, got {args.decoder_seq_length}")
    model = MetaModel.build(config, name, seq_length=seqs[0], decoder_seq_length=args.decoder_seq_length)
    _check_lengths(model, seqs)
    sweep = run_model_sweep(model, options, progress_enabled=not args.quiet)
    profiles = model_profiles(sweep)
    if args.report:
        with writing("--report", args.report):
            write_json_atomic(args.report, sweep_report(sweep))
    if args.galvatron_dir:
        with writing("--galvatron-dir", args.galvatron_dir):
            _write_reference(profiles, Path(args.galvatron_dir))
    for seq, profile in profiles.items():
        with writing("--output", paths[seq]):
            profile.save(paths[seq])
    print(summary(sweep, profiles, paths))
    return 0


def _check_lengths(model: object, seqs: list[int]) -> None:
    from galva_profiler.model_source import MetaModel

    assert isinstance(model, MetaModel)
    limit = model.constraints(seqs[-1]).max_seq_length
    if limit is not None and seqs[-1] > limit:
        raise ProfileError(f"--seq-lengths {seqs[-1]}: exceeds the model's {limit} learned positions")


def _write_reference(profiles: dict[int, ModelProfile], directory: Path) -> None:
    from galva_schema.reference import galvatron_model_profile_file_names, write_galvatron_model_profile

    directory.mkdir(parents=True, exist_ok=True)
    for seq, profile in profiles.items():
        computation, memory = galvatron_model_profile_file_names(f"{profile.model_name}_seqlen{seq}", profile.precision)
        write_galvatron_model_profile(profile, directory / computation, directory / memory)


def summary(sweep: object, profiles: dict[int, ModelProfile], paths: dict[int, Path]) -> str:
    from galva_profiler.model_profile import ModelSweep

    assert isinstance(sweep, ModelSweep)
    built = ", ".join(sweep.model.built)
    lines = [
        f"model profile: {sweep.model.name}, {sweep.model.num_layers} layers, built only: {built}; timed on "
        f"{sweep.options.device}"
    ]
    for m in sweep.layers:
        for seq, times in sorted(m.times.items()):
            fwd = sweep.batch_fit(times)
            bwd = sweep.batch_fit(times, backward=True)
            acts = m.activations[seq]
            tp = ", ".join(f"tp{d} {b / 2**20:.3f}" for d, b in acts.bytes_per_sample["tp"].items())
            lines.append(
                f"  {m.name} x{m.num_layers} seq {seq}: forward {fwd.coefficients[1]:.3f} ms + "
                f"{fwd.coefficients[0]:.3f} ms/sample (max residual {100 * fwd.max_relative_residual:.1f}%), "
                f"backward {bwd.coefficients[1]:.3f} ms + {bwd.coefficients[0]:.3f} ms/sample; "
                f"params {m.parameter_bytes / 2**20:.3f} MiB; activations MiB/sample {tp}; "
                f"checkpointed {acts.checkpoint_bytes_per_sample['tp'][1] / 2**20:.3f}"
            )
        seq_fit = sweep.sequence_fit(m.times)
        if seq_fit:
            a, b, c = seq_fit.coefficients
            lines.append(
                f"  {m.name} per-sample ms vs seq: {a:.3g} s^2 + {b:.3g} s + {c:.3g} "
                f"(max residual {100 * seq_fit.max_relative_residual:.1f}%)"
            )
    for seq, profile in profiles.items():
        v = profile.vocab
        lines.append(
            f"  vocabulary seq {seq}: states MiB by vocab tp {_fmt(v.memory_pp_off.model_states_mib)}, "
            f"activation MiB/sample first {_fmt(v.memory_pp_first.activation_mib_per_sample)} "
            f"last {_fmt(v.memory_pp_last.activation_mib_per_sample)}"
        )
        forms = [
            f"{name} {degree}: {len(form.embedding.calls) + len(form.head.calls)} calls, "
            f"{sum(form.embedding.overhead_ms) + sum(form.head.overhead_ms):.2f} ms of its own"
            for name, by_degree in v.forms.items()
            for degree, form in sorted(by_degree.items())
        ]  # fmt: skip
        if forms:
            lines.append(f"  vocabulary forms beyond the plain modules, a micro-batch: {'; '.join(forms)}")
        lines.append(f"  wrote {paths[seq]}")
    if all(p.constraints is None for p in profiles.values()):
        lines.append("  note: the model adapter gave no constraints")
    return "\n".join(lines)


def _fmt(values: dict[int, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:.3f}" for k, v in sorted(values.items())) + "}"
