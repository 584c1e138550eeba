"""The ``galva`` command.

    galva run [--out DIR] [--nproc N] [--memory 1300MiB] [--train-iters 40] [--num-layers 8] ...   # the whole job
    galva corpus -o corpus.jsonl [--documents 2000] [--seed 0]
    galva tokenizer corpus.jsonl -o tokenizer/ [--vocab-size 512]
    galva model-config -o model/ --tokenizer tokenizer/ [--num-layers 8 --hidden-size 128 ...]
    galva generate HF_DIR [--prompt "The cat"] [--max-new-tokens 16]
    galva check --metrics metrics.jsonl --strategy strategy.json --summary summary.json -o check.json

Bad input ends in one line ``galva: error: ...`` and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from galva_schema.argparsing import OneLineParser

__all__ = ["build_parser", "main"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    from galva.pipeline import CPU_MEMORY, PipelineOptions

    d = PipelineOptions()  # the one place galva run's defaults are written; help texts and subcommands read them
    # one-line errors, and no prefix taken for a flag (`--train-it` is not `--train-iters`), in every subcommand
    p = OneLineParser(
        prog="galva",
        description="Galva end to end: profile, search, train, save, export and generate on this machine.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run", help="the whole pipeline on this machine (the README's main command)",
        description="Corpus, tokenizer, preprocess, model config, profile hardware and model, search a plan under a "
        "memory budget, train it with a checkpoint, export to Hugging Face (g2h), generate with transformers, "
        "report. One line per stage; every artefact's path at the end (also in OUT/run.json).",
    )
    run.add_argument("--out", help=f"output directory (default {d.out})")
    run.add_argument("--force", action="store_true", default=None, help="replace a non-empty output directory")
    run.add_argument("--nproc", type=_positive, help="ranks (default: the local GPUs, or 4 CPU ranks with gloo)")
    run.add_argument("--quick", action="store_true",
                     help="the CI variant: 4 layers, 8 steps, a smaller corpus, 1-s profile timings (explicit flags "
                     "still win)")
    m = run.add_argument_group("model (a Llama-style decoder)")
    m.add_argument("--num-layers", type=_positive, help=f"decoder layers (default {d.num_layers})")
    m.add_argument("--hidden-size", type=_positive, help=f"default {d.hidden_size}")
    m.add_argument("--num-attention-heads", type=_positive, help=f"default {d.num_attention_heads}")
    m.add_argument(
        "--num-key-value-heads", type=_positive, help=f"default {d.num_key_value_heads} (grouped-query attention)"
    )
    m.add_argument("--ffn-hidden-size", type=_positive, help=f"default {d.ffn_hidden_size}")
    m.add_argument("--seq-length", type=_positive, help=f"default {d.seq_length}")
    m.add_argument("--vocab-size", type=_positive, help=f"tokenizer and model vocabulary (default {d.vocab_size})")
    m.add_argument("--documents", type=_positive, help=f"documents in the generated corpus (default {d.documents})")
    s = run.add_argument_group("plan and training")
    s.add_argument(
        "--memory", help=f"memory budget per device for the search, e.g. 1300MiB or 36GB (default {CPU_MEMORY} per "
        "CPU rank, a GPU's own memory on GPUs)"
    )
    s.add_argument("--context-memory", help="base memory per device the search reserves (default: measured, by "
                   "--calibration's run, else by the hardware profile)")
    s.add_argument("--calibration", help="calibration.json an earlier run's check stage wrote: the search uses its "
                   "factors and measured base")
    s.add_argument("--global-batch-size", type=_positive, help=f"default {d.global_batch_size}")
    s.add_argument("--train-iters", type=_positive, help=f"training steps (default {d.train_iters})")
    s.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr:g})")
    s.add_argument("--prompt", help="prompt for the generation stage")
    s.add_argument("--max-new-tokens", type=_positive, help=f"tokens to generate (default {d.max_new_tokens})")

    c = sub.add_parser("corpus", help="write the synthetic JSONL corpus", description="A deterministic "
                       "English-like corpus from a small grammar (galva.data), one {\"text\": ...} per line.")
    c.add_argument("-o", "--output", required=True, help="JSONL file to write")
    c.add_argument(
        "--documents", type=_positive, default=d.documents, help=f"number of documents (default {d.documents})"
    )
    c.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")

    t = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a JSONL corpus",
                       description="Train a byte-level BPE with the tokenizers library (nothing fetched) and save a "
                       "Hugging Face tokenizer directory.")
    t.add_argument("corpus", help="JSONL corpus")
    t.add_argument("-o", "--output", required=True, help="tokenizer directory to write")
    t.add_argument(
        "--vocab-size", type=_positive, default=d.vocab_size, help=f"at most this many tokens (default {d.vocab_size})"
    )
    t.add_argument("--json-key", default="text", help="key holding the text (default text)")

    mc = sub.add_parser("model-config", help="write a Llama-style Hugging Face config.json",
                        description="A LlamaConfig directory sized by the flags, with the tokenizer's special tokens "
                        "and files (galva-train --model-config DIR keeps them in every save, g2h writes them back).")
    mc.add_argument("-o", "--output", required=True, help="directory to write config.json into")
    mc.add_argument("--tokenizer", help="tokenizer directory: its bos/eos/pad ids go into the config, its files next "
                    "to it")
    mc.add_argument("--num-layers", type=_positive, default=d.num_layers)
    mc.add_argument("--hidden-size", type=_positive, default=d.hidden_size)
    mc.add_argument("--num-attention-heads", type=_positive, default=d.num_attention_heads)
    mc.add_argument("--num-key-value-heads", type=_positive, default=d.num_key_value_heads)
    mc.add_argument("--ffn-hidden-size", type=_positive, default=d.ffn_hidden_size)
    mc.add_argument("--vocab-size", type=_positive, default=d.vocab_size)
    mc.add_argument("--seq-length", type=_positive, default=d.seq_length, help="max_position_embeddings")

    g = sub.add_parser("generate", help="load a Hugging Face directory with transformers and generate",
                       description="Greedy generation from a local Hugging Face model directory (e.g. galva-ckpt "
                       "g2h's output with a tokenizer), local files only.")
    g.add_argument("model_dir", help="Hugging Face model directory (config.json, weights, tokenizer)")
    g.add_argument("--prompt", default=d.prompt, help="text to continue")
    g.add_argument("--max-new-tokens", type=_positive, default=d.max_new_tokens)
    g.add_argument("--json", help="also write the result here as JSON")
    k = sub.add_parser("check", help="a trained plan's measured step time and peak memory against its prediction",
                       description="Compare the step time and peak memory a galva-train run logged with what "
                       "galva-search predicted for its plan (galva.check: the bands, the calibration). Exit 0 "
                       "either way; the comparison is in the output file and on one line.")
    k.add_argument("--metrics", required=True, help="galva-train --metrics-jsonl file of the run")
    k.add_argument("--strategy", required=True, help="the strategy file the run trained")
    k.add_argument("--summary", required=True, help="the galva-search --summary-json written with it")
    k.add_argument("-o", "--output", required=True, help="check file to write (a galva_schema RunCheck)")
    k.add_argument("--calibration-output", help="calibration to write when a quantity is outside its noise band "
                   "(for galva-search --calibration)")
    k.add_argument("--calibration", help="the calibration the search used, if any: its factors are carried forward")
    return p


def _model_config(args: argparse.Namespace) -> str:
    from transformers import AutoTokenizer, LlamaConfig

    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} is not a multiple of --num-attention-heads "
                         f"{args.num_attention_heads}")
    if args.num_attention_heads % args.num_key_value_heads:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} is not a multiple of "
                         f"--num-key-value-heads {args.num_key_value_heads}")
    special: dict[str, Any] = {}
    if args.tokenizer:
        tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        if len(tok) > args.vocab_size:
            raise ValueError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's {len(tok)} tokens")
        special = {k: int(v) for k, v in (("bos_token_id", tok.bos_token_id), ("eos_token_id", tok.eos_token_id),
                                          ("pad_token_id", tok.pad_token_id)) if v is not None}
    config = LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads, max_position_embeddings=args.seq_length,
        tie_word_embeddings=False, **special,
    )
    config.save_pretrained(args.output)
    if args.tokenizer:  # a model directory with its tokenizer, as on a model hub: every save of the run keeps it
        tok.save_pretrained(args.output)
        return f"galva model-config: wrote {Path(args.output) / 'config.json'} and the tokenizer's files"
    return f"galva model-config: wrote {Path(args.output) / 'config.json'}"


def _check(args: argparse.Namespace) -> str:
    from galva.check import check_run, describe

    def path(value: str | None) -> Path | None:
        return Path(value) if value else None

    got = check_run(Path(args.metrics), Path(args.strategy), Path(args.summary), Path(args.output),
                    path(args.calibration_output), path(args.calibration))
    return f"galva check: {describe(got)}; wrote {args.output}" + (
        f" and {got.calibration}" if got.calibration else "")


def _run(args: argparse.Namespace) -> int:
    from galva.pipeline import options_from_args, run_pipeline

    run_pipeline(options_from_args(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``galva``; Ctrl-C or SIGTERM end it with one line (:mod:`galva_schema.interrupt`); ``galva run``
    passes the signal on to the stage running and waits for it to end the same way."""
    from galva_schema.interrupt import run_command

    return run_command("galva", lambda: _main(argv), end_process=argv is None)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_paths(args)  # before any work: a bad path is refused up front, nothing half-written
        if args.command == "run":
            return _run(args)
        if args.command == "corpus":
            from galva.data import write_corpus

            path = write_corpus(args.output, args.documents, args.seed)
            print(f"galva corpus: wrote {path} ({args.documents} documents)")
        elif args.command == "tokenizer":
            from galva.data import train_tokenizer

            size = train_tokenizer(args.corpus, args.output, args.vocab_size, args.json_key)
            print(f"galva tokenizer: wrote {args.output} ({size} tokens)")
        elif args.command == "model-config":
            print(_model_config(args))
        elif args.command == "check":
            print(_check(args))
        elif args.command == "generate":
            from galva.generate import generate

            got = generate(args.model_dir, args.prompt, args.max_new_tokens)
            result = {"prompt": got.prompt, "text": got.text, "new_tokens": got.new_tokens,
                      "model_class": got.model_class, "num_parameters": got.num_parameters}
            if args.json:
                from galva_schema import write_text_atomic

                write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
            print(f"galva generate: {got.model_class} ({got.num_parameters:,} parameters), {got.new_tokens} new "
                  f"tokens: {got.text!r}")
    except (ValueError, OSError) as err:
        print(f"galva: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2
    return 0


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse an input that is not there (or not the kind of path expected) and an output that cannot be written
    (a directory for a file, a file for a directory, a read-only or full file system): ``FLAG PATH: problem``."""
    from galva_schema import output_problem

    inputs: list[tuple[str, str | None, bool]] = []  # (flag, path, is a directory)
    outputs: list[tuple[str, str | None, bool]] = []
    if args.command == "corpus":
        outputs.append(("--output", args.output, False))
    elif args.command == "tokenizer":
        inputs.append(("corpus", args.corpus, False))
        outputs.append(("--output", args.output, True))
    elif args.command == "model-config":
        inputs.append(("--tokenizer", args.tokenizer, True))
        outputs.append(("--output", args.output, True))
    elif args.command == "generate":
        inputs.append(("model_dir", args.model_dir, True))
        outputs.append(("--json", args.json, False))
    elif args.command == "check":
        inputs += [(flag, getattr(args, flag[2:]), False) for flag in ("--metrics", "--strategy", "--summary",
                                                                         "--calibration")]
        outputs += [("--output", args.output, False), ("--calibration-output", args.calibration_output, False)]
    for flag, path, directory in inputs:
        if path is None:
            continue
        where = Path(path)
        if not where.exists():
            raise ValueError(f"{flag} {path}: no such {'directory' if directory else 'file'}")
        if directory and not where.is_dir():
            raise ValueError(f"{flag} {path}: is not a directory")
        if not directory and where.is_dir():
            raise ValueError(f"{flag} {path}: is a directory")
    for flag, path, directory in outputs:
        problem = None if path is None else output_problem(path, directory=directory)
        if problem is not None:
            raise ValueError(f"{flag} {path}: {problem}")


if __name__ == "__main__":
    sys.exit(main())
