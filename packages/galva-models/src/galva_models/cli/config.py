"""galva-train's argument surface and its validation, as a pure function: argv -> :class:`TrainConfig`.

Nothing here creates a process group or touches a device, so every bad flag combination is reported (one line,
non-zero exit) before torchrun's ranks start talking. Megatron-LM spellings are accepted as aliases of Galva's
flags (``--tensor-model-parallel-size`` = ``--tp`` ...), so Megatron launch scripts carry over.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from galva_models.adapters.base import FamilyAdapter, LayerSpec, Task
from galva_models.presets import PRESETS, UnknownPresetError, preset_config
from galva_schema import SchemaError, Strategy


class ConfigError(ValueError):
    """A bad galva-train argument combination; the message is one line."""


@dataclass(frozen=True)
class OptimArgs:
    lr: float
    min_lr: float
    warmup_iters: int
    weight_decay: float
    clip_grad: float | None
    adam_beta1: float
    adam_beta2: float
    adam_eps: float


@dataclass(frozen=True)
class TrainConfig:
    """Everything galva-train needs, validated. ``model_config`` is a transformers config (overrides applied)."""

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
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    log_interval: int = 1
    metrics_jsonl: str | None = None
    report_html: str | None = None
    tensorboard_dir: str | None = None
    progress: bool = True
    initialize_on_meta: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def task(self) -> Task:
        return self.adapter.task

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def global_batch_size(self) -> int:
        return self.strategy.global_batch_size


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a one-line :class:`ConfigError` instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="galva-train",
        description="Train a Hugging Face model under a Galva hybrid-parallel plan (launch with torchrun).",
        allow_abbrev=False,
    )
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--model", "--model-preset", dest="preset", help=f"Named preset: {', '.join(PRESETS)}.")
    src.add_argument("--model-config", help="Hugging Face config directory (config.json); nothing is fetched.")
    m.add_argument("--hf-checkpoint", help="Initialise from this Hugging Face model directory (local files only).")
    m.add_argument("--num-layers", type=int, help="Transformer layers (T5: encoder + decoder, split evenly).")
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--num-attention-heads", type=int)
    m.add_argument("--num-query-groups", "--num-key-value-heads", dest="num_query_groups", type=int)
    m.add_argument("--ffn-hidden-size", type=int)
    m.add_argument("--vocab-size", type=int)
    m.add_argument("--seq-length", "--encoder-seq-length", dest="seq_length", type=int, default=None)
    m.add_argument("--decoder-seq-length", type=int, help="T5 decoder length (default: --seq-length).")
    m.add_argument("--max-position-embeddings", type=int)
    m.add_argument("--attention-backend", choices=["sdpa", "flash"], default="sdpa")
    m.add_argument(
        "--initialize-on-meta",
        action="store_true",
        help="Build the model on the meta device; each rank initialises only its own modules (large models).",
    )

    s = p.add_argument_group("parallel plan (a --strategy file, or these global flags)")
    src_plan = s.add_mutually_exclusive_group()
    src_plan.add_argument("--strategy", help="Galva strategy JSON file (galva-search output).")
    src_plan.add_argument(
        "--galvatron-config-path",
        dest="galvatron_config",
        help="The reference system's galvatron_config_*.json, converted by galva-schema.",
    )
    s.add_argument("--world-size", type=int, help="Ranks (default: $WORLD_SIZE set by torchrun, else 1).")
    s.add_argument("--pp", "--pipeline-model-parallel-size", "--pp-deg", dest="pp", type=int)
    s.add_argument("--tp", "--tensor-model-parallel-size", "--global-tp-deg", dest="tp", type=int)
    s.add_argument("--tp-consecutive", type=int, choices=[0, 1])
    s.add_argument("--ulysses", "--use-ulysses", dest="ulysses", action="store_true", help="tp is the Ulysses degree.")
    s.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism on tp layers.")
    s.add_argument("--sdp", "--zero3", dest="sdp", action="store_true", help="ZeRO-3 on every layer.")
    s.add_argument("--default-dp-type", choices=["ddp", "zero2", "zero3"])
    s.add_argument(
        "--use-distributed-optimizer", action="store_true", help="Megatron alias of --default-dp-type zero2."
    )
    s.add_argument("--chunks", "--num-micro-batches", dest="chunks", type=int, help="Micro-batches per step.")
    s.add_argument("--checkpoint", "--global-checkpoint", dest="checkpoint", action="store_true")
    s.add_argument("--recompute-granularity", choices=["full", "selective"], help="Megatron: full = --checkpoint.")
    s.add_argument("--pipeline-schedule", "--pipeline-type", dest="pipeline_schedule", choices=["gpipe", "1f1b"])
    s.add_argument("--vocab-tp", type=int)
    s.add_argument("--vocab-sp", action="store_true")
    s.add_argument("--embed-sdp", action="store_true")

    b = p.add_argument_group("batch and precision")
    b.add_argument("--global-batch-size", "--global-train-batch-size", dest="global_batch_size", type=int)
    b.add_argument("--micro-batch-size", type=int, help="Samples per micro-batch per data-parallel rank.")
    prec = b.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true")
    prec.add_argument("--fp16", action="store_true")
    prec.add_argument("--fp32", action="store_true")
    prec.add_argument("--mixed-precision", choices=["fp32", "bf16", "fp16"])

    o = p.add_argument_group("optimizer")
    o.add_argument("--lr", type=float, default=1e-3)
    o.add_argument("--min-lr", type=float, default=0.0)
    o.add_argument("--lr-warmup-iters", type=int, default=0)
    o.add_argument("--lr-decay-style", choices=["cosine"], default="cosine")
    o.add_argument("--weight-decay", "--adam-weight-decay", dest="weight_decay", type=float, default=0.01)
    o.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping.")
    o.add_argument("--adam-beta1", type=float, default=0.9)
    o.add_argument("--adam-beta2", type=float, default=0.95)
    o.add_argument("--adam-eps", type=float, default=1e-8)
    o.add_argument("--train-iters", type=int, default=10)
    o.add_argument("--seed", type=int, default=1234)

    d = p.add_argument_group("data, checkpoints, logging")
    d.add_argument("--data-path", help="Megatron indexed dataset prefix (PREFIX.bin/.idx); default random tokens.")
    d.add_argument("--save")
    d.add_argument("--load")
    d.add_argument("--save-interval", type=int)
    d.add_argument("--log-interval", type=int, default=1)
    d.add_argument("--metrics-jsonl", help="Write one JSON object per step here.")
    d.add_argument("--report-html", help="At the end, write the step metrics as an HTML page of charts here.")
    d.add_argument("--tensorboard-dir")
    d.add_argument("--no-progress", action="store_true", help="No progress bar (plain log lines).")
    return p


def parse_train_config(argv: list[str] | None = None, world_size: int | None = None) -> TrainConfig:
    """Parse and validate galva-train's arguments. Raises :class:`ConfigError` (one line) on any problem."""
    args = build_parser().parse_args(argv)  # --help prints and exits 0; a bad flag raises ConfigError
    if world_size is None:
        world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    config, name = _model_config(args)
    from galva_models.adapters.registry import adapter_for

    try:
        adapter = adapter_for(config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _apply_overrides(config, adapter, args)
    seq = _seq_length(config, adapter, args)
    specs = _layer_specs(config, adapter, seq, args.decoder_seq_length)
    strategy = _strategy(args, world_size, len(specs))
    problem = adapter.plan_problem(strategy, config)
    if problem:
        raise ConfigError(problem)
    _check_plan_against_model(strategy, specs, config, name)
    if args.initialize_on_meta and args.hf_checkpoint is not None:
        raise ConfigError("--initialize-on-meta: weights come from --hf-checkpoint; drop one of the two")
    if args.train_iters < 1:
        raise ConfigError(f"--train-iters must be >= 1, got {args.train_iters}")
    same = (
        args.report_html
        and args.metrics_jsonl
        and os.path.abspath(args.report_html) == os.path.abspath(args.metrics_jsonl)
    )
    if same:
        raise ConfigError(f"--report-html {args.report_html} is the --metrics-jsonl file; use another name")
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
    if args.data_path is None and adapter.task is Task.MASKED_LM and getattr(config, "vocab_size", 0) < 2:
        raise ConfigError("masked LM needs a vocabulary of at least 2 tokens")
    optim = OptimArgs(
        lr=args.lr,
        min_lr=args.min_lr,
        warmup_iters=args.lr_warmup_iters,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad if args.clip_grad > 0 else None,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
    )
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    return TrainConfig(
        model_name=name,
        model_config=config,
        adapter=adapter,
        layer_specs=specs,
        strategy=strategy,
        seq_length=seq,
        decoder_seq_length=(args.decoder_seq_length or seq) if adapter.task is Task.SEQ2SEQ_LM else None,
        train_iters=args.train_iters,
        optim=optim,
        seed=args.seed,
        attention_backend=args.attention_backend,
        data_path=args.data_path,
        hf_checkpoint=args.hf_checkpoint,
        save=args.save,
        load=args.load,
        save_interval=args.save_interval,
        log_interval=args.log_interval,
        metrics_jsonl=args.metrics_jsonl,
        report_html=args.report_html,
        tensorboard_dir=args.tensorboard_dir,
        progress=not args.no_progress,
        initialize_on_meta=args.initialize_on_meta,
    )


# ------------------------------------------------------------------------------------------------------ the model
def _model_config(args: argparse.Namespace) -> tuple[Any, str]:
    if args.preset is None and args.model_config is None and args.hf_checkpoint is None:
        raise ConfigError(
            f"give --model PRESET, --model-config DIR or --hf-checkpoint DIR (presets: {', '.join(PRESETS)})"
        )
    if args.preset is not None:
        try:
            return preset_config(args.preset), args.preset
        except UnknownPresetError as err:
            raise ConfigError(str(err)) from None
    directory = Path(args.model_config or args.hf_checkpoint)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{directory}: no config.json (expected a Hugging Face model or config directory)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True), directory.name
    except (OSError, ValueError) as err:
        raise ConfigError(f"{directory}: cannot read config.json: {str(err).splitlines()[0]}") from None


_FFN_NAMES = ("intermediate_size", "n_inner", "d_ff")


def _apply_overrides(config: Any, adapter: FamilyAdapter, args: argparse.Namespace) -> None:
    family = adapter.name
    if args.num_layers is not None:
        if adapter.set_num_layers is None:
            raise ConfigError(f"--num-layers: {family} has per-stage depths; edit them in a --model-config instead")
        try:
            adapter.set_num_layers(config, args.num_layers)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if family == "swin" and any(v is not None for v in (args.hidden_size, args.num_attention_heads)):
        raise ConfigError("--hidden-size/--num-attention-heads: swin has per-stage sizes; use a --model-config")
    if args.hidden_size is not None:
        config.hidden_size = args.hidden_size  # attribute_map turns this into n_embd / d_model where needed
    if args.num_attention_heads is not None:
        config.num_attention_heads = args.num_attention_heads
    if args.num_query_groups is not None:
        if not hasattr(config, "num_key_value_heads"):
            raise ConfigError(f"--num-query-groups: {family} has no grouped-query attention")
        config.num_key_value_heads = args.num_query_groups
    if args.ffn_hidden_size is not None:
        name = next((n for n in _FFN_NAMES if hasattr(config, n)), None)
        if name is None:
            raise ConfigError(f"--ffn-hidden-size: {family} has no feed-forward size field")
        setattr(config, name, args.ffn_hidden_size)
    if args.vocab_size is not None:
        config.vocab_size = args.vocab_size
    if args.max_position_embeddings is not None:
        config.max_position_embeddings = args.max_position_embeddings
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    if family != "swin" and family != "t5" and heads and hidden and hidden % heads:
        raise ConfigError(f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads}")
    kv = getattr(config, "num_key_value_heads", None)
    if kv and heads and heads % kv:
        raise ConfigError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {kv}")


def _seq_length(config: Any, adapter: FamilyAdapter, args: argparse.Namespace) -> int:
    if adapter.task is Task.IMAGE_CLASSIFICATION:
        if args.seq_length is not None:
            raise ConfigError(f"--seq-length: {adapter.name} takes images; its sequence follows image and patch size")
        return 0
    default = min(1024, getattr(config, "max_position_embeddings", None) or 1024)
    seq = args.seq_length or default
    if seq < 2:
        raise ConfigError(f"--seq-length must be >= 2, got {seq}")
    limit = getattr(config, "max_position_embeddings", None) if adapter.name in {"gpt2", "bert"} else None
    if limit is not None and seq > limit:
        raise ConfigError(f"--seq-length {seq} exceeds the model's {limit} learned positions")
    return seq


def _layer_specs(config: Any, adapter: FamilyAdapter, seq: int, decoder_seq: int | None) -> list[LayerSpec]:
    try:
        if adapter.task is Task.SEQ2SEQ_LM:
            return adapter.layer_specs(config, seq, decoder_seq)
        return adapter.layer_specs(config, seq)
    except ValueError as err:
        raise ConfigError(str(err)) from None


# ------------------------------------------------------------------------------------------------------- the plan
_PLAN_FLAGS = (
    "pp", "tp", "tp_consecutive", "ulysses", "sequence_parallel", "sdp", "default_dp_type", "chunks", "checkpoint",
    "recompute_granularity", "pipeline_schedule", "vocab_tp", "vocab_sp", "embed_sdp", "use_distributed_optimizer",
)  # fmt: skip


def _precision(args: argparse.Namespace) -> str | None:
    if args.mixed_precision:
        return args.mixed_precision
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32" if args.fp32 else None


def _strategy(args: argparse.Namespace, world_size: int, num_layers: int) -> Strategy:
    precision = _precision(args)
    if precision == "fp16":
        raise ConfigError("--fp16: fp16 needs loss scaling, which Galva does not do; use --bf16 or --fp32")
    if args.galvatron_config is not None:
        return _galvatron_strategy(args, world_size, num_layers, precision or "bf16")
    if args.strategy is not None:
        given = [f for f in _PLAN_FLAGS if getattr(args, f) not in (None, False)]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag}: the plan comes from --strategy {args.strategy}; drop the global flag")
        try:
            strategy = Strategy.load(args.strategy)
        except SchemaError as err:
            raise ConfigError(str(err)) from None
        src = args.strategy
        if strategy.world_size != world_size:
            raise ConfigError(
                f"{src}: world_size: the strategy has {strategy.world_size} ranks, the run has {world_size}"
            )
        if strategy.num_layers != num_layers:
            raise ConfigError(
                f"{src}: layers: the strategy has {strategy.num_layers} layers, the model has {num_layers}"
            )
        if args.global_batch_size is not None and args.global_batch_size != strategy.global_batch_size:
            raise ConfigError(
                f"--global-batch-size {args.global_batch_size} differs from {src}'s {strategy.global_batch_size}"
            )
        updates: dict[str, Any] = {}
        if precision is not None:
            updates["mixed_precision"] = precision
        if updates:
            strategy = Strategy.model_validate({**strategy.model_dump(), **updates})
        return strategy
    return _global_strategy(args, world_size, num_layers, precision or "bf16")


def _galvatron_strategy(args: argparse.Namespace, world_size: int, num_layers: int, precision: str) -> Strategy:
    """A reference ``galvatron_config_*.json``: ``--sequence-parallel`` and the precision are flags there too."""
    from galva_schema.reference import read_galvatron_strategy

    given = [f for f in _PLAN_FLAGS if f != "sequence_parallel" and getattr(args, f) not in (None, False)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(f"{flag}: the plan comes from --galvatron-config-path; drop the global flag")
    try:
        strategy = read_galvatron_strategy(
            args.galvatron_config,
            world_size=world_size,
            global_batch_size=args.global_batch_size,
            mixed_precision=precision,
            megatron_sp=args.sequence_parallel,
        )
    except SchemaError as err:
        raise ConfigError(str(err)) from None
    if strategy.num_layers != num_layers:
        where = f"{args.galvatron_config}: tp_sizes_enc"
        raise ConfigError(f"{where}: the file has {strategy.num_layers} layers, the model has {num_layers}")
    return strategy


def _global_strategy(args: argparse.Namespace, world_size: int, num_layers: int, precision: str) -> Strategy:
    pp, tp = args.pp or 1, args.tp or 1
    if world_size % pp:
        raise ConfigError(f"--pp {pp} does not divide the {world_size} ranks")
    if (world_size // pp) % tp:
        raise ConfigError(f"--tp {tp} does not divide the {world_size // pp} ranks of a pipeline stage")
    if num_layers < pp:
        raise ConfigError(f"--pp {pp} is more than the model's {num_layers} layers")
    vocab_tp = args.vocab_tp or 1
    dp = world_size // pp // tp  # Megatron's data-parallel degree: --micro-batch-size is per transformer-layer replica
    chunks = args.chunks
    gbs = args.global_batch_size
    if args.micro_batch_size is not None:
        if gbs is None:
            gbs = args.micro_batch_size * dp * (chunks or 1)
        if gbs % (args.micro_batch_size * dp):
            raise ConfigError(
                f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {args.micro_batch_size} x "
                f"data-parallel degree {dp}"
            )
        derived = gbs // (args.micro_batch_size * dp)
        if chunks is not None and chunks != derived:
            raise ConfigError(f"--chunks {chunks} contradicts --micro-batch-size (which gives {derived} micro-batches)")
        chunks = derived
    gbs = gbs or world_size // pp // min(tp, vocab_tp) * (chunks or 1)  # one sample per rank of the widest split
    if args.recompute_granularity == "selective":
        raise ConfigError("--recompute-granularity selective is not supported; use full (= --checkpoint)")
    dp_type = args.default_dp_type or ("zero2" if args.use_distributed_optimizer else "ddp")
    from galva_hp.global_mode import GlobalFlags, strategy_from_flags

    flags = GlobalFlags(
        world_size=world_size,
        num_layers=num_layers,
        global_batch_size=gbs,
        pp=pp,
        tp=tp,
        tp_consecutive=bool(args.tp_consecutive if args.tp_consecutive is not None else 1),
        ulysses=args.ulysses,
        megatron_sp=args.sequence_parallel,
        sdp=args.sdp,
        default_dp_type=dp_type,
        chunks=chunks or 1,
        checkpoint=args.checkpoint or args.recompute_granularity == "full",
        pipeline_type=args.pipeline_schedule or "1f1b",
        vocab_tp=vocab_tp,
        vocab_sp=args.vocab_sp,
        embed_sdp=args.embed_sdp,
        mixed_precision=precision,
    )
    from pydantic import ValidationError

    from galva_schema.errors import from_validation_error

    try:
        return strategy_from_flags(flags)
    except ValidationError as err:
        raise ConfigError(str(from_validation_error(err, "global flags"))) from None
    except (SchemaError, ValueError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None


def _check_plan_against_model(strategy: Strategy, specs: list[LayerSpec], config: Any, name: str) -> None:
    """Head and sequence divisibility, layer by layer; one line naming the first failing layers."""
    problems: dict[str, list[int]] = {}
    for index, (layer, spec) in enumerate(zip(strategy.layers, specs)):
        degree = layer.tp
        what = "Ulysses degree" if layer.ulysses else "tp"
        msg = None
        if degree > 1 and spec.num_heads % degree:
            msg = f"{what} {degree} does not divide the {spec.num_heads} attention heads of {spec.layer_type} layers"
        elif degree > 1 and not layer.ulysses and spec.num_kv_heads % degree and degree % spec.num_kv_heads:
            # galva-hp splits K/V heads when tp divides them and replicates one per rank when they divide tp;
            # Ulysses repeats K/V heads as needed, so only the query heads matter there
            msg = (
                f"tp {degree} and the {spec.num_kv_heads} key/value heads of {spec.layer_type} layers do not divide "
                "one another"
            )
        elif degree > 1 and (layer.ulysses or strategy.megatron_sp) and spec.seq_length % degree:
            kind = "Ulysses" if layer.ulysses else "Megatron-SP"
            msg = f"{kind} degree {degree} does not divide the sequence of {spec.seq_length} tokens"
        if msg:
            problems.setdefault(msg, []).append(index)
    if problems:
        from galva_schema.errors import format_indices

        msg, indices = next(iter(problems.items()))
        raise ConfigError(f"{name}: layers[{format_indices(indices)}]: {msg}")
    if strategy.vocab.sp and specs and specs[0].seq_length % strategy.vocab.tp:
        raise ConfigError(f"vocab.sp: degree {strategy.vocab.tp} does not divide the sequence of {specs[0].seq_length}")
