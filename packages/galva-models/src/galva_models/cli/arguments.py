"""galva-train's flags: the argparse parser and nothing else (validation lives in the modules that use them).

Megatron-LM and Galvatron spellings are aliases of Galva's flags (``--tensor-model-parallel-size`` = ``--tp``,
``--pp-deg`` = ``--pp`` ...), so their launch scripts carry over. Every flag here changes what a run does, or is
refused with one line.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any, NoReturn

from galva_hp.optim import DECAY_STYLES
from galva_models.cli.errors import ConfigError
from galva_models.presets import PRESETS
from galva_schema import PipelineSchedule
from galva_schema.argparsing import OneLineParser
from galva_schema.reference import PIPELINE_TYPES


class _Parser(OneLineParser):
    """The shared one-line parser, but a bad flag is raised as :class:`ConfigError` (every rank finds it, one says
    it: :func:`galva_models.cli.train.main`) instead of printed here; every value flag is stored by :class:`_Once`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


class _Once(argparse._StoreAction):
    """``store``, remembering which spelling the user typed (``spelled(args, dest)``); a flag given twice, or with
    an alias (``--tp 2 --tensor-model-parallel-size 1``), with two different values is refused instead of the last
    one silently winning."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: Any = None
    ) -> None:
        seen: dict[str, tuple[str, Any]] = namespace.__dict__.setdefault("_spelled", {})
        if self.dest in seen and seen[self.dest][1] != values:
            before, value = seen[self.dest]
            raise ConfigError(f"{option_string} {_show(values)} contradicts {before} {_show(value)}; give one")
        seen[self.dest] = (str(option_string), values)
        setattr(namespace, self.dest, values)


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def spelled(args: argparse.Namespace, dest: str) -> str:
    """The flag as the user typed it (an alias included), else its first spelling."""
    seen = getattr(args, "_spelled", {})
    if dest in seen:
        return str(seen[dest][0])
    return "--" + dest.replace("_", "-")


RANGES: dict[str, tuple[float, float | None, bool]] = {
    # dest: (minimum, maximum or None, whether the maximum is excluded)
    "num_layers": (1, None, False), "hidden_size": (1, None, False), "num_attention_heads": (1, None, False),
    "num_query_groups": (1, None, False), "ffn_hidden_size": (1, None, False), "vocab_size": (1, None, False),
    "seq_length": (2, None, False), "decoder_seq_length": (2, None, False), "max_position_embeddings": (1, None, False),
    "world_size": (1, None, False), "pp": (1, None, False), "tp": (1, None, False), "micro_batches": (1, None, False),
    "virtual_stages": (1, None, False), "ep": (1, None, False), "etp": (1, None, False),
    "vocab_tp": (1, None, False), "global_batch_size": (1, None, False), "micro_batch_size": (1, None, False),
    "lr": (0, None, False), "min_lr": (0, None, False), "lr_warmup_iters": (0, None, False),
    "weight_decay": (0, None, False), "clip_grad": (0, None, False), "adam_beta1": (0, 1, True),
    "adam_beta2": (0, 1, True), "adam_eps": (0, None, False), "train_iters": (1, None, False), "seed": (0, None, False),
    "save_interval": (1, None, False), "keep_last": (0, None, False), "exit_interval": (1, None, False),
    "log_interval": (1, None, False), "collective_timeout": (0, None, False), "nproc_per_node": (1, None, False),
}  # fmt: skip
"""Every numeric flag's range; ``collective_timeout`` and ``adam_eps`` must also be above their minimum."""
_ABOVE_MINIMUM = {"collective_timeout", "adam_eps"}


def check_ranges(args: argparse.Namespace) -> None:
    """Refuse a numeric flag outside its range (``--tp 0``, ``--lr nan``), naming the flag as typed."""
    for dest, (low, high, high_open) in RANGES.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        flag = spelled(args, dest)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value}")
        if dest in _ABOVE_MINIMUM and value <= low:
            raise ConfigError(f"{flag} must be > {low:g}, got {value:g}")
        if value < low:
            raise ConfigError(f"{flag} must be >= {low:g}, got {value:g}")
        if high is not None and (value >= high if high_open else value > high):
            raise ConfigError(f"{flag} must be {'<' if high_open else '<='} {high:g}, got {value:g}")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse galva-train's flags and check every numeric range (:class:`ConfigError` on the first problem)."""
    args = build_parser().parse_args(argv)
    check_ranges(args)
    return args


def build_parser() -> argparse.ArgumentParser:
    """The galva-train parser; ``parse_args`` raises :class:`ConfigError` on a malformed flag."""
    p = _Parser(
        prog="galva-train",
        description="Train a Hugging Face model under a Galva hybrid-parallel plan (launch with torchrun).",
        allow_abbrev=False,
    )
    _model_flags(p)
    _plan_flags(p)
    _batch_flags(p)
    _optimizer_flags(p)
    _output_flags(p)
    f = p.add_argument_group("faults")
    f.add_argument(
        "--collective-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="Every process group's timeout from the first step on, and how long a rank may make no progress before "
        "the watchdog ends the job with one line naming it (default 600; start-up may take at least 300).",
    )
    return p


def _model_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--model", "--model-preset", dest="preset", help=f"Named preset: {', '.join(PRESETS)}.")
    src.add_argument("--model-config", help="Hugging Face config directory (config.json); nothing is fetched.")
    src.add_argument("--hf-checkpoint", help="Hugging Face model directory: config and weights (local files only).")
    m.add_argument("--num-layers", type=int, help="Transformer layers (T5: encoder + decoder, split evenly).")
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--num-attention-heads", type=int)
    m.add_argument("--num-query-groups", "--num-key-value-heads", dest="num_query_groups", type=int)
    m.add_argument("--ffn-hidden-size", type=int)
    m.add_argument("--vocab-size", type=int)
    m.add_argument("--seq-length", "--encoder-seq-length", dest="seq_length", type=int, default=None)
    m.add_argument(
        "--decoder-seq-length", type=int, help="Encoder-decoder models: decoder length (default: --seq-length)."
    )
    m.add_argument("--max-position-embeddings", type=int)
    m.add_argument("--attention-backend", choices=["sdpa", "flash"], default="sdpa")
    m.add_argument(
        "--initialize-on-meta",
        action="store_true",
        help="Build the model on the meta device; each rank initialises only its own modules (large models).",
    )


def _plan_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("parallel plan (a --strategy file, a --galvatron-config-path file, or these flags)")
    src_plan = s.add_mutually_exclusive_group()
    src_plan.add_argument("--strategy", help="Galva strategy JSON file (galva-search output).")
    src_plan.add_argument(
        "--galvatron-config-path",
        dest="galvatron_config",
        help="The reference system's galvatron_config_*.json, converted by galva-schema.",
    )
    s.add_argument("--world-size", type=int, help="Ranks (default: $WORLD_SIZE set by torchrun, else 1).")
    s.add_argument(
        "--nproc-per-node",
        type=int,
        help="Start this many ranks on this machine (instead of torchrun): the flags are checked once, and a "
        "failed rank ends the job with one line.",
    )
    s.add_argument("--pp", "--pipeline-model-parallel-size", "--pp-deg", dest="pp", type=int)
    s.add_argument("--tp", "--tensor-model-parallel-size", "--global-tp-deg", dest="tp", type=int)
    s.add_argument("--tp-consecutive", type=int, choices=[0, 1])
    s.add_argument("--ulysses", "--use-ulysses", dest="ulysses", action="store_true", help="tp is the Ulysses degree.")
    s.add_argument(
        "--cp",
        "--context-parallel-size",
        dest="cp",
        type=int,
        help="Context-parallel degree of every layer and the vocabulary layers: ring attention, each rank holding two "
        "chunks of the sequence (per layer: the strategy file's cp).",
    )
    s.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism on tp layers.")
    s.add_argument("--sdp", "--zero3", dest="sdp", action="store_true", help="ZeRO-3 on every layer.")
    s.add_argument("--default-dp-type", choices=["ddp", "zero2", "zero3"])
    s.add_argument(
        "--use-distributed-optimizer", action="store_true", help="Megatron alias of --default-dp-type zero2."
    )
    s.add_argument(
        "--num-micro-batches", "--chunks", dest="micro_batches", type=int, metavar="N",
        help="Micro-batches per step (--chunks: the reference's name for them).",
    )  # fmt: skip
    s.add_argument("--checkpoint", "--global-checkpoint", dest="checkpoint", action="store_true")
    s.add_argument("--recompute-granularity", choices=["full", "selective"], help="Megatron: full = --checkpoint.")
    s.add_argument(
        "--pipeline-schedule",
        "--pipeline-type",
        dest="pipeline_schedule",
        choices=list(dict.fromkeys([*(schedule.value for schedule in PipelineSchedule), *PIPELINE_TYPES])),
        help="Default: 1f1b, or interleaved-1f1b with --virtual-stages > 1.",
    )
    s.add_argument(
        "--virtual-stages",
        "--num-virtual-stages-per-pipeline-rank",
        dest="virtual_stages",
        type=int,
        help="Model chunks per pipeline stage (interleaved-1f1b; the layers are split into pp x v chunks).",
    )
    s.add_argument(
        "--ep",
        "--expert-model-parallel-size",
        dest="ep",
        type=int,
        help="Expert-parallel degree: the experts of every layer that has them split over ep ranks.",
    )
    s.add_argument(
        "--etp",
        "--expert-tensor-parallel-size",
        dest="etp",
        type=int,
        help="Expert tensor-parallel degree: each expert's FFN split over etp ranks (ep x etp divides a stage).",
    )
    s.add_argument(
        "--expert-dp-type",
        choices=["ddp", "zero2", "zero3"],
        help="Data-parallel type of the expert replicas (default: the layer's).",
    )
    s.add_argument("--vocab-tp", type=int)
    s.add_argument("--vocab-sp", action="store_true")
    s.add_argument("--embed-sdp", action="store_true", help="ZeRO-3 on the embedding and the head.")


def _batch_flags(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("batch and precision")
    b.add_argument("--global-batch-size", "--global-train-batch-size", dest="global_batch_size", type=int)
    b.add_argument("--micro-batch-size", type=int, help="Samples per micro-batch per data-parallel rank.")
    prec = b.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true")
    prec.add_argument("--fp16", action="store_true")
    prec.add_argument("--fp32", action="store_true")
    prec.add_argument("--mixed-precision", choices=["fp32", "bf16", "fp16"])


def _optimizer_flags(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("optimizer")
    o.add_argument("--lr", type=float, default=1e-3)
    o.add_argument("--min-lr", type=float, default=0.0)
    o.add_argument("--lr-warmup-iters", type=int, default=0)
    o.add_argument(
        "--lr-decay-style",
        choices=DECAY_STYLES,
        default="cosine",
        help="After warm-up: cosine or linear from --lr to --min-lr at --train-iters, or constant --lr.",
    )
    o.add_argument("--weight-decay", "--adam-weight-decay", dest="weight_decay", type=float, default=0.01)
    o.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping.")
    o.add_argument("--adam-beta1", type=float, default=0.9)
    o.add_argument("--adam-beta2", type=float, default=0.95)
    o.add_argument("--adam-eps", type=float, default=1e-8)
    o.add_argument("--train-iters", type=int, default=10)
    o.add_argument(
        "--override-lr-schedule",
        "--override-opt_param-scheduler",
        dest="override_lr_schedule",
        action="store_true",
        help="With --load: run the schedule these flags give (--train-iters, --lr, --min-lr, --lr-warmup-iters, "
        "--lr-decay-style) from the saved step on, where they differ from the checkpoint's (else refused).",
    )
    o.add_argument("--seed", type=int, default=1234)


def _output_flags(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("data, checkpoints, logging")
    d.add_argument("--data-path", help="Megatron indexed dataset prefix (PREFIX.bin/.idx); default random tokens.")
    d.add_argument("--save", help="Save layerwise checkpoints here (DIR/step-<N>/), every rank writing its shards.")
    d.add_argument("--save-interval", type=int, help="Save every N steps (and always after the last step).")
    d.add_argument("--keep-last", type=int, default=0, help="Keep only the newest K saves in --save (0: all).")
    d.add_argument(
        "--load",
        help="Continue from a Galva checkpoint (or the newest complete save of a --save DIR), under any plan; "
        "a Hugging Face directory or h2g output gives weights only. The model comes from it unless named.",
    )
    d.add_argument("--finetune", action="store_true", help="With --load: weights only (step 0, fresh optimizer).")
    d.add_argument("--exit-interval", type=int, help="Stop after the step that is a multiple of N (Megatron).")
    d.add_argument("--log-interval", type=int, default=1, help="Print a log line every N steps.")
    d.add_argument("--metrics-jsonl", help="Write one JSON object per step here.")
    d.add_argument("--report-html", help="At the end, write the step metrics as an HTML page of charts here.")
    d.add_argument("--tensorboard-dir", help="TensorBoard scalars here (needs the tensorboard extra).")
    d.add_argument("--no-progress", action="store_true", help="No progress bar (plain log lines).")
