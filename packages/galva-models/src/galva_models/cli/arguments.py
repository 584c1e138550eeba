"""galva-train's flags: the argparse parser and nothing else (validation lives in the modules that use them).

Megatron-LM and Galvatron spellings are aliases of Galva's flags (``--tensor-model-parallel-size`` = ``--tp``,
``--pp-deg`` = ``--pp`` ...), so their launch scripts carry over. Every flag here changes what a run does, or is
refused with one line.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from galva_hp.optim import DECAY_STYLES
from galva_models.cli.errors import ConfigError
from galva_models.presets import PRESETS


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a one-line :class:`ConfigError` instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


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
