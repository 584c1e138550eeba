"""The one error a user can cause: bad input. The command prints it on one line and exits 2."""

from __future__ import annotations


class ProfileError(Exception):
    """Bad input (unknown preset, a sweep on one rank, an unwritable output...): one line, no traceback."""
