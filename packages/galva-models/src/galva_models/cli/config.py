"""galva-train's arguments as a pure function: argv -> validated :class:`TrainConfig`.

Nothing here creates a process group or touches a device, so every bad flag combination is reported (one line,
non-zero exit) before torchrun's ranks start talking. The jobs are split by module: :mod:`.arguments` (the flags),
:mod:`.model_source` (which model, size overrides), :mod:`.plan_source` (which plan); this module joins them and
checks the run options (data, logging, optimizer).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from galva_models.cli import model_source, plan_source
from galva_models.cli.arguments import build_parser, parse
from galva_models.cli.errors import ConfigError
from galva_models.tables.family import FamilyAdapter, LayerSpec, Task
from galva_schema import Strategy, plan_problems

__all__ = ["ConfigError", "OptimArgs", "TrainConfig", "build_parser", "parse_train_config"]


@dataclass(frozen=True)
class OptimArgs:
    """AdamW and learning-rate schedule settings (``clip_grad`` None: no clipping)."""

    lr: float
    min_lr: float
    warmup_iters: int
    decay_style: str
    weight_decay: float
    clip_grad: float | None
    adam_beta1: float
    adam_beta2: float
    adam_eps: float


@dataclass(frozen=True)
class CheckpointArgs:
    """Saving and loading (``--save DIR --save-interval N --keep-last K``, ``--load DIR [--finetune]``)."""

    save: str | None = None
    save_interval: int | None = None
    keep_last: int = 0
    load: str | None = None
    finetune: bool = False
    exit_interval: int | None = None


@dataclass(frozen=True)
class TrainConfig:
    """Everything galva-train needs, validated. ``model_config`` is a transformers config (overrides applied),
    ``layer_specs`` its boundary shapes (for the FLOP count); ``strategy`` passed the model's constraints."""

    model_name: str
    model_config: Any
    adapter: FamilyAdapter
    layer_specs: list[LayerSpec]
    strategy: Strategy
    seq_length: int
    decoder_seq_length: int | None
    train_iters: int
    optim: OptimArgs
    seed: int
    attention_backend: str = "sdpa"
    data_path: str | None = None
    hf_checkpoint: str | None = None
    model_dir: str | None = None  # --model-config or --hf-checkpoint: its tokenizer files go into every save
    log_interval: int = 1
    metrics_jsonl: str | None = None
    report_html: str | None = None
    tensorboard_dir: str | None = None
    progress: bool = True
    initialize_on_meta: bool = False
    checkpoint: CheckpointArgs = CheckpointArgs()
    collective_timeout_s: float = 600.0
    plan_source: str = "flags"
    plan_overrides: tuple[str, ...] = ()
    launch_ranks: int | None = None  # --nproc-per-node: galva-train starts the ranks itself

    @property
    def task(self) -> Task:
        return self.adapter.task

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def global_batch_size(self) -> int:
        return self.strategy.global_batch_size

    @property
    def lr_schedule(self) -> dict[str, Any]:
        """The learning-rate schedule's settings, saved with every checkpoint (a resume must repeat them)."""
        return lr_schedule(self.train_iters, self.optim)


SCHEDULE_FLAGS = {
    "train_iters": "train_iters", "lr": "lr", "min_lr": "min_lr", "warmup_iters": "lr_warmup_iters",
    "decay_style": "lr_decay_style",
}  # fmt: skip
"""The learning-rate schedule's settings (:func:`lr_schedule`) and the flags (argparse dests) that give them."""


def lr_schedule(train_iters: int, optim: OptimArgs) -> dict[str, Any]:
    """What the learning rate of every step follows from (galva-hp's ``lr_factor``), as JSON values."""
    return {
        "train_iters": train_iters,
        "lr": optim.lr,
        "min_lr": optim.min_lr,
        "warmup_iters": optim.warmup_iters,
        "decay_style": optim.decay_style,
    }


def parse_train_config(argv: list[str] | None = None, world_size: int | None = None) -> TrainConfig:
    """Parse and validate galva-train's arguments. Raises :class:`ConfigError` (one line) on any problem."""
    args = parse(argv)  # --help prints and exits 0; a bad flag or a value out of range raises ConfigError
    if args.nproc_per_node and args.world_size and args.nproc_per_node != args.world_size:
        raise ConfigError(f"--world-size {args.world_size} contradicts --nproc-per-node {args.nproc_per_node}")
    if world_size is None:
        world_size = args.world_size or args.nproc_per_node or int(os.environ.get("WORLD_SIZE", "1"))
    _check_checkpoint_flags(args)
    resumed = _resumed_run(args)
    config, name = model_source.model_config(args)
    from galva_models.tables.registry import adapter_for

    try:
        adapter = adapter_for(config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    model_source.apply_overrides(config, adapter, args)
    seq, decoder_seq = model_source.seq_lengths(config, adapter, args)
    specs = model_source.layer_specs(config, adapter, seq, decoder_seq)
    constraints = adapter.constraints(config, seq or None, decoder_seq).model_copy(update={"model_name": name})
    precision = resumed.mixed_precision.value if resumed is not None and resumed.mixed_precision else None
    strategy, overrides = plan_source.strategy_and_overrides(args, world_size, constraints.num_layers, precision)
    # the one check of a plan against a model: galva-hp's build asks the same function
    problems = plan_problems(strategy, constraints, world_size=world_size, seq_len=seq or None)
    if problems:
        raise ConfigError(f"{plan_source.plan_label(args, name)}: " + "; ".join(problems))
    _check_run_options(args, adapter, config, name)
    _check_load_family(args, config, name)
    optim = _optim(args)
    _check_resumed_schedule(args, optim, resumed)
    return TrainConfig(
        model_name=name,
        model_config=config,
        adapter=adapter,
        layer_specs=specs,
        strategy=strategy,
        seq_length=seq,
        decoder_seq_length=decoder_seq,
        train_iters=args.train_iters,
        optim=optim,
        seed=args.seed,
        attention_backend=args.attention_backend,
        data_path=args.data_path,
        hf_checkpoint=args.hf_checkpoint,
        model_dir=args.model_config or args.hf_checkpoint,
        log_interval=args.log_interval,
        metrics_jsonl=args.metrics_jsonl,
        report_html=args.report_html,
        tensorboard_dir=args.tensorboard_dir,
        progress=not args.no_progress,
        initialize_on_meta=args.initialize_on_meta,
        checkpoint=_checkpoint_args(args),
        collective_timeout_s=args.collective_timeout,
        plan_source=(
            f"--strategy {args.strategy}"
            if args.strategy
            else f"--galvatron-config-path {args.galvatron_config}"
            if args.galvatron_config
            else "flags"
        ),
        plan_overrides=tuple(overrides),
        launch_ranks=args.nproc_per_node,
    )


def _checkpoint_args(args: argparse.Namespace) -> CheckpointArgs:
    return CheckpointArgs(args.save, args.save_interval, args.keep_last, args.load, args.finetune, args.exit_interval)


def _check_checkpoint_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--save-interval", args.save_interval), ("--exit-interval", args.exit_interval)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.keep_last < 0:
        raise ConfigError(f"--keep-last must be >= 0, got {args.keep_last}")
    if args.save is None and (args.save_interval is not None or args.keep_last):
        raise ConfigError(f"{'--save-interval' if args.save_interval is not None else '--keep-last'} needs --save DIR")
    if args.finetune and args.load is None:
        raise ConfigError("--finetune loads weights only from --load DIR; give --load")
    if args.load is not None and args.hf_checkpoint is not None:
        raise ConfigError("--load and --hf-checkpoint both give the weights; drop one")
    if args.load is not None:
        from galva_ckpt.errors import CheckpointError
        from galva_ckpt.sources import resolve

        try:
            resolve(args.load, warn=False)
        except CheckpointError as err:
            raise ConfigError(f"--load: {err}") from None


def _resumed_run(args: argparse.Namespace) -> Any:
    """The manifest of the checkpoint a ``--load`` run continues (optimizer, schedule and step); None for a fresh
    run, ``--finetune`` (weights only) and a checkpoint of weights only (Hugging Face, h2g)."""
    if args.override_lr_schedule and (args.load is None or args.finetune):
        why = "a --finetune run starts a fresh schedule" if args.finetune else "give --load DIR"
        raise ConfigError(f"--override-lr-schedule changes the schedule of a run resumed with --load; {why}")
    if args.load is None or args.finetune:
        return None
    from galva_ckpt.errors import CheckpointError
    from galva_ckpt.sources import open_weights

    try:
        manifest = open_weights(args.load, warn=False).manifest
    except (CheckpointError, ValueError):
        return None  # reported by the --load checks themselves
    return manifest if manifest is not None and manifest.optimizer is not None else None


def _check_resumed_schedule(args: argparse.Namespace, optim: OptimArgs, resumed: Any) -> None:
    """A resumed run follows the schedule it was saved under (as Megatron-LM checks): a schedule flag that differs
    from the checkpoint's is refused, unless ``--override-lr-schedule`` runs the new schedule from the saved step."""
    from galva_models.cli.arguments import spelled

    if resumed is None or args.override_lr_schedule:
        return
    saved = (resumed.scheduler or {}).get("schedule")
    if not isinstance(saved, dict):
        return  # saved before galva-train recorded its schedule
    given = lr_schedule(args.train_iters, optim)
    for key, dest in SCHEDULE_FLAGS.items():
        if key in saved and saved[key] != given[key]:
            flag = spelled(args, dest)
            default = "" if dest in getattr(args, "_spelled", {}) else " (the default)"
            raise ConfigError(
                f"{flag} {given[key]}{default} differs from the {saved[key]} the checkpoint --load {args.load} was "
                f"saved with: resume with {flag} {saved[key]}, or add --override-lr-schedule to run the new schedule "
                f"from step {resumed.step}"
            )


def _check_run_options(args: argparse.Namespace, adapter: FamilyAdapter, config: Any, name: str) -> None:
    """Everything but the model and the plan: initialisation, iterations, outputs, backend, data."""
    if args.initialize_on_meta and args.hf_checkpoint is not None:
        raise ConfigError("--initialize-on-meta: weights come from --hf-checkpoint; drop one of the two")
    if args.train_iters < 1:
        raise ConfigError(f"--train-iters must be >= 1, got {args.train_iters}")
    if args.log_interval < 1:
        raise ConfigError(f"--log-interval must be >= 1, got {args.log_interval}")
    same = (
        args.report_html
        and args.metrics_jsonl
        and os.path.abspath(args.report_html) == os.path.abspath(args.metrics_jsonl)
    )
    if same:
        raise ConfigError(f"--report-html {args.report_html} is the --metrics-jsonl file; use another name")
    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard-dir: tensorboard is not installed (pip install 'galva-models[tensorboard]')")
    if args.attention_backend == "flash":
        from galva_models.attention import AttentionBackendError, attn_implementation

        try:
            attn_implementation("flash")
        except AttentionBackendError as err:
            raise ConfigError(str(err)) from None
    if args.data_path is not None:
        if adapter.task is not Task.CAUSAL_LM:
            raise ConfigError(f"--data-path: indexed datasets feed causal LMs; {name} is {adapter.task.value}")
        for suffix in (".bin", ".idx"):
            if not Path(args.data_path + suffix).is_file():
                raise ConfigError(f"--data-path: {args.data_path}{suffix} does not exist")
        from galva_models.data.indexed import check_dataset

        try:  # truncated files and token ids beyond the vocabulary, before the first step
            check_dataset(args.data_path, getattr(config, "vocab_size", None))
        except ValueError as err:
            raise ConfigError(f"--data-path: {err}") from None
    _check_outputs(args)
    if args.data_path is None and adapter.task is Task.MASKED_LM and getattr(config, "vocab_size", 0) < 2:
        raise ConfigError("masked LM needs a vocabulary of at least 2 tokens")


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output can be written before the first step (not a directory, not /proc, not a full disk)."""
    from galva_schema import output_problem

    outputs = (
        ("--metrics-jsonl", args.metrics_jsonl, False),
        ("--report-html", args.report_html, False),
        ("--save", args.save, True),
        ("--tensorboard-dir", args.tensorboard_dir, True),
    )
    for flag, path, directory in outputs:
        if path is not None:
            problem = output_problem(path, directory=directory)
            if problem is not None:
                raise ConfigError(f"{flag} {path}: {problem}")


def _check_load_family(args: argparse.Namespace, config: Any, name: str) -> None:
    """``--load`` with a model named by ``--model`` / ``--model-config``: the checkpoint must be of the same family."""
    if args.load is None or (args.preset is None and args.model_config is None):
        return
    from galva_ckpt.errors import CheckpointError
    from galva_ckpt.sources import open_weights

    try:
        theirs = open_weights(args.load, warn=False).config.get("model_type")
    except (CheckpointError, ValueError, AttributeError):
        return  # unreadable checkpoints are reported by the --load check itself
    ours = getattr(config, "model_type", None)
    if theirs and ours and theirs != ours:
        flag = f"--model {args.preset}" if args.preset else f"--model-config {args.model_config}"
        raise ConfigError(f"--load {args.load}: a {theirs} checkpoint, but {flag} is a {ours} model")


def _optim(args: argparse.Namespace) -> OptimArgs:
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.lr_warmup_iters < 0:
        raise ConfigError(f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    return OptimArgs(
        lr=args.lr,
        min_lr=args.min_lr,
        warmup_iters=args.lr_warmup_iters,
        decay_style=args.lr_decay_style,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad if args.clip_grad > 0 else None,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
    )
