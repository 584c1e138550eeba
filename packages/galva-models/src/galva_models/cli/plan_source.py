"""Which plan galva-train runs: a ``--strategy`` file, a reference ``--galvatron-config-path`` file, or the global
flags (``--pp --tp ...``), each turned into one validated :class:`galva_schema.Strategy`.

A plan flag given next to a plan file is refused rather than silently ignored or merged.
"""

from __future__ import annotations

import argparse

from galva_comm.layout import ranks_per_stage
from galva_models.cli.arguments import spelled
from galva_models.cli.errors import ConfigError
from galva_schema import DataParallelType, PipelineSchedule, Precision, SchemaError, Strategy
from galva_schema.reference import PIPELINE_TYPES

PLAN_FLAGS = (
    "pp", "tp", "tp_consecutive", "ulysses", "cp", "sequence_parallel", "sdp", "default_dp_type", "micro_batches",
    "checkpoint", "recompute_granularity", "pipeline_schedule", "virtual_stages", "vocab_tp", "vocab_sp", "embed_sdp",
    "use_distributed_optimizer", "micro_batch_size", "ep", "etp", "expert_dp_type",
)  # fmt: skip
"""Flags that describe a plan; a plan file describes all of it."""


def plan_label(args: argparse.Namespace, model_name: str) -> str:
    """What a plan problem is prefixed with: the plan file, or the model for a plan given by flags."""
    return str(args.strategy or args.galvatron_config or model_name)


def strategy(args: argparse.Namespace, world_size: int, num_layers: int) -> Strategy:
    """The run's Strategy from whichever of the three sources the flags name (not yet checked against the model:
    that is :func:`galva_schema.plan_problems`)."""
    return strategy_and_overrides(args, world_size, num_layers)[0]


def strategy_and_overrides(
    args: argparse.Namespace, world_size: int, num_layers: int, resumed_precision: str | None = None
) -> tuple[Strategy, list[str]]:
    """:func:`strategy`, and what the flags changed in a plan file (``--fp32 overrides plan.json's bf16``), which
    the start-of-run banner prints. ``resumed_precision``: that of the run a ``--load`` continues, the precision
    of a plan given by flags unless one is given (a resume never switches it silently)."""
    precision = _precision(args)
    if precision == "fp16":
        raise ConfigError("--fp16: fp16 needs loss scaling, which Galva does not do; use --bf16 or --fp32")
    default, kept = "bf16", []
    if resumed_precision is not None and precision is None:
        default, kept = resumed_precision, [f"{resumed_precision} kept from --load {args.load}"]
    if args.galvatron_config is not None:
        return _galvatron_strategy(args, world_size, num_layers, precision or default), kept
    if args.strategy is not None:
        plan = _file_strategy(args, None)
        overrides: list[str] = []
        if precision is not None and precision != plan.mixed_precision.value:
            flag = f"--mixed-precision {precision}" if args.mixed_precision else f"--{precision}"
            overrides.append(f"{flag} overrides {args.strategy}'s {plan.mixed_precision.value}")
            plan = Strategy.model_validate({**plan.model_dump(), "mixed_precision": precision})
        return plan, overrides
    return _global_strategy(args, world_size, num_layers, precision or default), kept


def _precision(args: argparse.Namespace) -> str | None:
    if args.mixed_precision:
        return str(args.mixed_precision)
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32" if args.fp32 else None


def _refuse_plan_flags(args: argparse.Namespace, source: str, allowed: tuple[str, ...] = ()) -> None:
    given = [f for f in PLAN_FLAGS if f not in allowed and getattr(args, f) not in (None, False)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(f"{flag}: the plan comes from {source}; drop the global flag")


def _file_strategy(args: argparse.Namespace, precision: str | None) -> Strategy:
    """A galva-schema strategy file; only the precision may be changed by a flag. Whether it fits the model and
    the run is :func:`galva_schema.plan_problems`' question, asked by the caller."""
    src = args.strategy
    _refuse_plan_flags(args, f"--strategy {src}")
    try:
        plan = Strategy.load(src)
    except SchemaError as err:
        raise ConfigError(str(err)) from None
    if args.global_batch_size is not None and args.global_batch_size != plan.global_batch_size:
        raise ConfigError(f"--global-batch-size {args.global_batch_size} differs from {src}'s {plan.global_batch_size}")
    if precision is not None:
        plan = Strategy.model_validate({**plan.model_dump(), "mixed_precision": precision})
    return plan


def _galvatron_strategy(args: argparse.Namespace, world_size: int, num_layers: int, precision: str) -> Strategy:
    """A reference ``galvatron_config_*.json``: ``--sequence-parallel`` and the precision are flags there too."""
    from galva_schema.reference import read_galvatron_strategy

    _refuse_plan_flags(args, "--galvatron-config-path", allowed=("sequence_parallel",))
    try:
        plan = read_galvatron_strategy(
            args.galvatron_config,
            world_size=world_size,
            global_batch_size=args.global_batch_size,
            mixed_precision=precision,
            megatron_sp=args.sequence_parallel,
        )
    except SchemaError as err:
        raise ConfigError(str(err)) from None
    if plan.num_layers != num_layers:
        where = f"{args.galvatron_config}: tp_sizes_enc"
        raise ConfigError(f"{where}: the file has {plan.num_layers} layers, the model has {num_layers}")
    return plan


def _dp_type(args: argparse.Namespace) -> str:
    """``--default-dp-type``, or its Megatron spelling; contradicting spellings are refused."""
    if args.use_distributed_optimizer and args.default_dp_type not in (None, "zero2"):
        raise ConfigError(
            f"--use-distributed-optimizer is zero2; it contradicts --default-dp-type {args.default_dp_type}"
        )
    if args.sdp and args.default_dp_type not in (None, "zero3"):
        raise ConfigError(f"--sdp is ZeRO-3 on every layer; it contradicts --default-dp-type {args.default_dp_type}")
    return str(args.default_dp_type or ("zero2" if args.use_distributed_optimizer else "ddp"))


def _batch(args: argparse.Namespace, per_stage: int, tp: int, vocab_tp: int, cp: int = 1) -> tuple[int, int]:
    """(global batch size, micro-batches) on stages of ``per_stage`` ranks; ``--micro-batch-size`` is per
    transformer-layer replica (Megatron)."""
    dp = per_stage // tp // cp
    micro_batches, gbs = args.micro_batches, args.global_batch_size
    if args.micro_batch_size is not None:
        if gbs is None:
            gbs = args.micro_batch_size * dp * (micro_batches or 1)
        if gbs % (args.micro_batch_size * dp):
            raise ConfigError(
                f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {args.micro_batch_size} x "
                f"data-parallel degree {dp}"
            )
        derived = gbs // (args.micro_batch_size * dp)
        if micro_batches is not None and micro_batches != derived:
            flag = spelled(args, "micro_batches")
            raise ConfigError(
                f"{flag} {micro_batches} contradicts --micro-batch-size (which gives {derived} micro-batches)"
            )
        micro_batches = derived
    # a sample per rank of the widest split
    gbs = gbs or per_stage // min(tp, vocab_tp) // cp * (micro_batches or 1)
    return gbs, micro_batches or 1


def _global_strategy(args: argparse.Namespace, world_size: int, num_layers: int, precision: str) -> Strategy:
    pp, tp = args.pp or 1, args.tp or 1
    if world_size % pp:
        raise ConfigError(f"--pp {pp} does not divide the {world_size} ranks")
    per_stage = ranks_per_stage(world_size, pp)
    if per_stage % tp:
        raise ConfigError(f"--tp {tp} does not divide the {per_stage} ranks of a pipeline stage")
    cp = args.cp or 1
    if per_stage % (tp * cp) or per_stage % ((args.vocab_tp or 1) * cp):
        degree = tp if per_stage % (tp * cp) else args.vocab_tp
        what = f"--tp {tp}" if degree == tp else f"--vocab-tp {degree}"
        verb = "is more than" if degree * cp > per_stage else "does not divide"
        raise ConfigError(f"{what} x --cp {cp} {verb} the {per_stage} ranks of a pipeline stage")
    virtual_stages = args.virtual_stages or 1
    if num_layers < pp * virtual_stages:
        what = f"--pp {pp}" if virtual_stages == 1 else f"--pp {pp} x --virtual-stages {virtual_stages} chunks"
        raise ConfigError(f"{what} is more than the model's {num_layers} layers")
    if args.recompute_granularity == "selective":
        raise ConfigError("--recompute-granularity selective is not supported; use full (= --checkpoint)")
    vocab_tp = args.vocab_tp or 1
    if args.sequence_parallel and tp == 1 and vocab_tp == 1:
        raise ConfigError("--sequence-parallel splits the sequence of tp layers; it needs --tp or --vocab-tp > 1")
    gbs, micro_batches = _batch(args, per_stage, tp, vocab_tp, cp)
    schedule = args.pipeline_schedule or ("interleaved-1f1b" if virtual_stages > 1 else "1f1b")
    default_dp = DataParallelType(_dp_type(args))  # checks --sdp against --default-dp-type too
    dp_type = DataParallelType.ZERO3 if args.sdp else default_dp
    from pydantic import ValidationError

    from galva_schema.errors import from_validation_error

    try:
        return Strategy.uniform(
            world_size=world_size,
            num_layers=num_layers,
            global_batch_size=gbs,
            layer={
                "tp": tp,
                "tp_consecutive": bool(args.tp_consecutive if args.tp_consecutive is not None else 1),
                "ulysses": args.ulysses,
                "cp": cp,
                "checkpoint": args.checkpoint or args.recompute_granularity == "full",
                "ep": args.ep or 1,
                "etp": args.etp or 1,
                "expert_dp_type": args.expert_dp_type,
            },
            pp=pp,
            pipeline_schedule=PIPELINE_TYPES.get(schedule) or PipelineSchedule(schedule),
            virtual_stages=virtual_stages,
            num_micro_batches=micro_batches,
            mixed_precision=Precision(precision),
            default_dp_type=dp_type,
            megatron_sp=args.sequence_parallel,
            vocab={
                "tp": vocab_tp,
                "sp": args.vocab_sp,
                "cp": cp,
                "dp_type": DataParallelType.ZERO3 if args.embed_sdp else None,
            },
            description="global mode",
        )
    except ValidationError as err:
        raise ConfigError(str(from_validation_error(err, "global flags"))) from None
    except (SchemaError, ValueError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None
