"""The ``galva-ckpt`` command: ``h2g``, ``g2h`` and ``info``.

Every failure the user can cause (a wrong or damaged input, a non-empty output) ends in one line
``galva-ckpt: error: ...`` naming the file and tensor, and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from galva_ckpt.errors import CheckpointError
from galva_schema.argparsing import OneLineParser
from galva_schema.stderr import quiet_transformers

__all__ = ["main"]

PROG = "galva-ckpt"


def build_parser() -> argparse.ArgumentParser:
    # one-line errors, and no prefix taken for a flag (`--max-shard` is not `--max-shard-size`), in every subcommand
    parser = OneLineParser(prog=PROG, description="Layerwise Galva checkpoints and Hugging Face conversion.")
    commands = parser.add_subparsers(dest="command", required=True)

    h2g = commands.add_parser("h2g", help="Hugging Face safetensors directory -> Galva checkpoint directory.")
    h2g.add_argument("hf_dir", help="Directory with config.json and model.safetensors (or an index and shards).")
    h2g.add_argument("out_dir", help="Galva checkpoint directory to create.")

    g2h = commands.add_parser("g2h", help="Galva checkpoint directory -> Hugging Face directory.")
    g2h.add_argument("galva_dir", help="Galva checkpoint directory (with manifest.json), or a galva-train --save "
                     "directory: its newest complete save, as --load takes it.")
    g2h.add_argument("out_dir", help="Hugging Face directory to create (from_pretrained loads it).")
    g2h.add_argument(
        "--max-shard-size", default="50GB", help="Largest output file, e.g. 5GB, 500MB, 2GiB (default: 50GB)."
    )
    for sub in (h2g, g2h):
        sub.add_argument("--force", action="store_true", help="Replace a non-empty output directory.")
        sub.add_argument("--no-progress", action="store_true", help="No progress bar on stderr.")

    info = commands.add_parser("info", help="Print what a Galva checkpoint holds and verify every checksum.")
    info.add_argument("dir", help="Galva checkpoint directory, or a galva-train --save directory (its newest "
                      "complete save).")
    info.add_argument("--no-verify", action="store_true", help="Skip the sha256 check of every file.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (2 for a user error, printed as one line; Ctrl-C or SIGTERM: one line,
    130 / 143, the output directory left as it was, see :mod:`galva_schema.interrupt`)."""
    from galva_schema.interrupt import run_command

    return run_command(PROG, lambda: _main(argv), end_process=argv is None)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet_transformers()  # config notes and advice are noise for a file conversion (also when already imported)
    try:
        return _run(args, parser)
    except CheckpointError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # disk full, permissions: name the file, no traceback (the output is left as it was)
        if err.filename:
            where = f"{err.filename}: "
        else:  # a failed write() names no file: it was one of the output's
            out = getattr(args, "out_dir", None)
            where = f"cannot write {out}: " if out else ""
        print(f"{PROG}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from galva_ckpt.convert import galva_to_hf, hf_to_galva
    from galva_ckpt.hf import parse_size
    from galva_ckpt.info import describe
    from galva_ckpt.sources import resolve_save

    if args.command == "h2g":
        manifest = hf_to_galva(args.hf_dir, args.out_dir, force=args.force, progress=not args.no_progress)
        print(f"{args.out_dir}: {manifest.model_family}, {len(manifest.modules)} modules, {len(manifest.files)} files")
    elif args.command == "g2h":
        try:
            max_shard = parse_size(args.max_shard_size)
        except ValueError as err:
            parser.error(f"--max-shard-size: {err}")
        source = resolve_save(args.galva_dir)
        files = galva_to_hf(
            source, args.out_dir, max_shard_size=max_shard, force=args.force, progress=not args.no_progress
        )
        weights = [f for f in files if f.endswith(".safetensors")]
        others = [f for f in files if f not in weights]
        taken = "" if source == Path(args.galva_dir) else f" (from {source}, the newest complete save)"
        print(f"{args.out_dir}: {len(weights)} weight file(s), {', '.join(others)}{taken}")
    else:
        print(describe(args.dir, verify=not args.no_verify))
    return 0


if __name__ == "__main__":
    sys.exit(main())
