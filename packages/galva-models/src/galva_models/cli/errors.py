"""The one error type of galva-train's argument checks."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn


class ConfigError(ValueError):
    """A bad galva-train argument combination; the message is one line."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose bad-flag message is one line, ``PROG: error: ...`` (exit 2), without the usage block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # a prefix is no flag: `--model` is never taken as `--model-config`
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
