"""The argument parser of every Galva command: a bad flag is one line, ``CMD: error: ...`` (exit 2), never argparse's
usage block above it (issue #22), and a prefix is never taken for a flag."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

__all__ = ["OneLineParser", "positive_floats", "positive_ints"]


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are the command's one-line errors.

    ``CMD: error: MESSAGE (see CMD SUBCOMMAND --help)`` on stderr, exit status 2. ``CMD`` is the command's own name
    in a subcommand too (``galva-ckpt: error: ...``, not ``galva-ckpt info: error: ...``); ``add_subparsers`` makes
    its subcommands of this class. ``allow_abbrev`` is off: ``--model`` is never read as ``--model-config``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        command = self.prog.split(" ", 1)[0]  # a subcommand's prog is "CMD SUBCOMMAND"
        print(f"{command}: error: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def positive_floats(text: str) -> list[float]:
    """An argparse ``type``: comma-separated positive numbers (``1,4,16``)."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):  # `not >` refuses nan too
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def positive_ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated positive integers (``128,256``)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
