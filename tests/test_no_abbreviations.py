"""No Galva command takes a prefix for a flag (issue #22): argparse's ``allow_abbrev`` is off in every parser and
subparser, so ``galva-profile model --model-conf DIR`` is refused instead of silently read as ``--model-config``
(``--model`` itself names a preset, as in galva-train).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator

import pytest

BUILDERS = {  # every command's parser, subcommands included
    "galva": "galva.cli:build_parser",
    "galva-ckpt": "galva_ckpt.cli:build_parser",
    "galva-data": "galva_models.cli.data:build_parser",
    "galva-profile": "galva_profiler.cli:build_parser",
    "galva-schema": "galva_schema.cli:build_parser",
    "galva-search": "galva_search.cli:build_parser",
    "galva-train": "galva_models.cli.arguments:build_parser",
}
MAINS = {
    **{prog: target.replace(":build_parser", ":main") for prog, target in BUILDERS.items()},
    "galva-train": "galva_models.cli.train:main",
    "galva-report": "galva_models.report:main",
}
# (command, arguments with an abbreviated flag, the abbreviation, the flag it is a unique prefix of)
CASES = [
    ("galva", ["run", "--train-it", "2"], "--train-it", "--train-iters"),
    ("galva", ["corpus", "-o", "c.jsonl", "--doc", "5"], "--doc", "--documents"),
    ("galva-ckpt", ["g2h", "in", "out", "--max-shard", "5GB"], "--max-shard", "--max-shard-size"),
    ("galva-data", ["preprocess", "--input", "c.jsonl", "--tokenizer", "t", "--output-prefix", "p", "--json", "k"],
     "--json", "--json-key"),
    ("galva-profile", ["model", "--model-conf", "cfg", "--seq-lengths", "64"], "--model-conf", "--model-config"),
    ("galva-schema", ["convert", "--to-galvatron-strategy", "s.json", "-o", "out.json", "--world", "8"], "--world",
     "--world-size"),
    ("galva-search", ["--hardware-profile", "hw.json", "--model-profile", "m.json", "--summary", "s.json"],
     "--summary", "--summary-json"),
    ("galva-train", ["--model", "tiny-llama", "--train-iter", "2"], "--train-iter", "--train-iters"),
    ("galva-report", ["metrics.jsonl", "--summ", "summary.json", "--strategy", "plan.json"], "--summ", "--summary"),
]  # fmt: skip


def _load(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser that reads ``argv``'s flags: the subcommand's, if ``argv`` starts with one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and argv[0] in action.choices:
            return action.choices[argv[0]]
    return parser


@pytest.mark.parametrize("prog", sorted(BUILDERS))
def test_every_parser_and_subparser_refuses_prefixes(prog):
    found = dict(_parsers(_load(BUILDERS[prog])()))
    assert found and {name: p.allow_abbrev for name, p in found.items()} == dict.fromkeys(found, False)


@pytest.mark.parametrize(("prog", "argv", "short", "flag"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_an_abbreviated_flag_is_refused_in_one_line(prog, argv, short, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # nothing the command might write lands in the checkout
    if prog in BUILDERS:  # the flag exists and the abbreviation is a unique prefix of it: it would have been taken
        parser = _command_parser(_load(BUILDERS[prog])(), argv)
        assert [f for f in parser._option_string_actions if f.startswith(short)] == [flag]
    try:
        code = _load(MAINS[prog])(argv)
    except SystemExit as done:
        code = done.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err  # no usage block above the line (galva_schema.argparsing)
    assert err.startswith(f"{prog}: error: unrecognized arguments: {short}"), err
