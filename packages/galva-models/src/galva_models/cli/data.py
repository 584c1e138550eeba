"""``galva-data``: dataset preparation. ``galva-data preprocess --input corpus.jsonl --tokenizer DIR ...``."""

from __future__ import annotations

import argparse
import sys

from galva_schema.argparsing import OneLineParser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="galva-data", description="Prepare training data for galva-train.")
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser(
        "preprocess", help="Tokenise a JSONL corpus into a Megatron indexed dataset (PREFIX.bin / PREFIX.idx)."
    )
    pre.add_argument("--input", required=True, help="JSONL file, one document per line.")
    pre.add_argument("--json-key", default="text", help="Key holding the text (default: text).")
    pre.add_argument("--tokenizer", required=True, help="Local Hugging Face tokenizer directory (nothing is fetched).")
    pre.add_argument("--output-prefix", required=True, help="Writes PREFIX.bin and PREFIX.idx.")
    pre.add_argument("--append-eod", action="store_true", help="Append the tokenizer's eos token to each document.")
    pre.add_argument("--workers", type=int, default=1, help="Tokeniser processes (default 1).")
    pre.add_argument("--quiet", action="store_true", help="No progress bar.")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``galva-data``; Ctrl-C or SIGTERM end it with one line (:mod:`galva_schema.interrupt`)."""
    from galva_schema.interrupt import run_command

    return run_command("galva-data", lambda: _main(argv), end_process=argv is None)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print(f"galva-data: error: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    from galva_schema import output_problem

    for suffix in (".bin", ".idx"):
        problem = output_problem(args.output_prefix + suffix)
        if problem is not None:
            print(f"galva-data: error: --output-prefix {args.output_prefix}{suffix}: {problem}", file=sys.stderr)
            return 2
    from galva_models.data.preprocess import preprocess

    try:
        result = preprocess(
            args.input,
            args.tokenizer,
            args.output_prefix,
            json_key=args.json_key,
            append_eod=args.append_eod,
            workers=args.workers,
            progress=not args.quiet,
        )
    except (OSError, ValueError) as err:
        print(f"galva-data: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {result.bin_path} and {result.idx_path}: {result.documents} documents, {result.tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
