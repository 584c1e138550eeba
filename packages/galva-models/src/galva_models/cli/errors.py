"""The one error type of galva-train's argument checks."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ConfigError(ValueError):
    """A bad galva-train argument combination; the message is one line."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose bad-flag message is one line, ``PROG: error: ...`` (exit 2), without the usage block."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
