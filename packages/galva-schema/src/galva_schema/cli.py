"""The ``galva-schema`` command: validate Galva files, export JSON Schemas, convert reference strategies.

::

    galva-schema validate FILE...
    galva-schema export-schemas [DIR]                      (default: docs/schemas)
    galva-schema convert --from-galvatron-strategy IN [--world-size W] -o OUT
    galva-schema convert --to-galvatron-strategy IN -o OUT

Exit status: 0 when everything is valid, 1 when a file is bad (one ``galva-schema: error: FILE: field: problem``
line per file on stderr), 2 for a usage error (one ``galva-schema: error: ...`` line).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from galva_schema._base import GalvaFile, load_json_object
from galva_schema.argparsing import OneLineParser
from galva_schema.errors import SchemaError

PROG = "galva-schema"


def _error(message: object) -> None:
    """Every error line of every command: ``galva-schema: error: ...`` (docs/troubleshooting.md)."""
    print(f"{PROG}: error: {message}", file=sys.stderr)


def _kinds() -> dict[str, type[GalvaFile]]:
    from galva_schema import FILE_TYPES

    return {cls.KIND: cls for cls in FILE_TYPES.values()}


def validate_file(path: str | Path) -> GalvaFile:
    """Load ``path`` as the Galva file type named by its ``kind`` key; raises :class:`SchemaError`."""
    path = Path(path)
    data = load_json_object(path)
    kinds = _kinds()
    kind = data.get("kind")
    if kind not in kinds:
        hint = (
            " (a reference Galvatron file? convert it with `galva-schema convert`)"
            if "pp_deg" in data or "tp_sizes_enc" in data
            else ""
        )
        raise SchemaError(
            f"kind: {'missing' if kind is None else repr(kind) + ' is unknown'}; expected one of "
            f"{', '.join(sorted(kinds))}{hint}",
            source=str(path),
        )
    return kinds[kind].from_dict(data, source=path)


def _validate(args: argparse.Namespace) -> int:
    status = 0
    for name in args.files:
        try:
            loaded = validate_file(name)
        except SchemaError as err:
            _error(err)
            status = 1
        else:
            print(f"{name}: OK ({loaded.KIND})")
    return status


def _export(args: argparse.Namespace) -> int:
    from galva_schema.files import output_problem
    from galva_schema.schemas import export_schemas

    problem = output_problem(args.directory, directory=True)  # before any file: no partial set, no empty directory
    if problem is not None:
        _error(f"{args.directory}: {problem}")
        return 2
    try:
        written = export_schemas(args.directory)
    except OSError as err:
        _error(f"{err.filename or args.directory}: cannot write: {err.strerror or err}")
        return 2
    for path in written:
        print(path)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from galva_schema.files import output_problem
    from galva_schema.reference.strategy import read_galvatron_strategy, write_galvatron_strategy
    from galva_schema.strategy import Strategy

    problem = output_problem(args.output)
    if problem is not None:
        _error(f"--output {args.output}: {problem}")
        return 2
    try:
        if args.from_galvatron_strategy:
            strategy = read_galvatron_strategy(
                args.from_galvatron_strategy,
                world_size=args.world_size,
                global_batch_size=args.global_batch_size,
                mixed_precision=args.mixed_precision,
                megatron_sp=args.megatron_sp,
            )
            strategy.save(args.output)
        else:
            write_galvatron_strategy(Strategy.load(args.to_galvatron_strategy), args.output)
    except SchemaError as err:
        _error(err)
        return 1
    except OSError as err:  # checked above; a disk that filled up since is still one line
        _error(f"--output {args.output}: cannot write: {err.strerror or err}")
        return 2
    print(f"wrote {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    validate = commands.add_parser("validate", help="check Galva files (the kind comes from their `kind` key)")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.set_defaults(run=_validate)

    export = commands.add_parser("export-schemas", help="write docs/schemas/<name>.schema.json")
    export.add_argument("directory", nargs="?", default="docs/schemas", metavar="DIR")
    export.set_defaults(run=_export)

    convert = commands.add_parser("convert", help="convert a strategy from or to the reference (Galvatron) format")
    source = convert.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-galvatron-strategy", metavar="IN", help="a galvatron_config_*.json")
    source.add_argument("--to-galvatron-strategy", metavar="IN", help="a Galva strategy JSON")
    convert.add_argument("--world-size", type=int, help="ranks (needed unless the reference file has world_size)")
    convert.add_argument("--global-batch-size", type=int, help="only for reference files without global_bsz")
    convert.add_argument("--mixed-precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    convert.add_argument("--megatron-sp", action="store_true", help="the run uses Megatron sequence parallelism")
    convert.add_argument("-o", "--output", required=True, metavar="OUT")
    convert.set_defaults(run=_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``galva-schema`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
