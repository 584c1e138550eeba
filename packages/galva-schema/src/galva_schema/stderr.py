"""A command's stderr holds its own lines: one per problem (the project's bad-input contract)."""

from __future__ import annotations

import os
import sys


def quiet_transformers() -> None:
    """Keep transformers' advice (an attention mask for random token ids, config notes) off stderr: set before
    transformers is imported (the variable reaches the ranks a launcher starts), and after, for a run in one process.
    Its errors still show."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" in sys.modules:
        sys.modules["transformers"].logging.set_verbosity_error()
