"""The one error type of galva-train's argument checks."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad galva-train argument combination; the message is one line."""
