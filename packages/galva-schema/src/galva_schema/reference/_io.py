"""Reading the reference system's JSON files with one-line errors that name the file and the key."""

from __future__ import annotations

import math
import os
from typing import Any

from galva_schema._base import load_json_object
from galva_schema.errors import SchemaError

__all__ = ["PathLike", "integer", "load_json_object", "number", "plain"]

PathLike = str | os.PathLike[str]


def number(value: Any, key: str, source: str | None, *, what: str, positive: bool = False) -> float:
    """A finite number (bools are not numbers); ``positive`` also rejects zero and negatives."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SchemaError(f"{key}: expected a number of {what}, got {_short(value)}", source=source)
    if positive and value <= 0:
        raise SchemaError(f"{key}: expected a positive number of {what}, got {value!r}", source=source)
    if not positive and value < 0:
        raise SchemaError(f"{key}: expected a non-negative number of {what}, got {value!r}", source=source)
    return float(value)


def integer(value: Any, key: str, source: str | None, *, minimum: int = 1, text: bool = False) -> int:
    """An integer >= ``minimum``; accepts ``2`` and ``2.0`` (the reference writes both), and ``"2"`` only where the
    reference writes text (``text``: an item of a comma-separated list, a JSON object key). A string or a boolean
    where the reference writes a number is refused, never coerced."""
    parsed: int | None = None
    if isinstance(value, bool):
        parsed = None
    elif isinstance(value, int):
        parsed = value
    elif isinstance(value, float) and value.is_integer():
        parsed = int(value)
    elif text and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        parsed = int(value.strip())
    if parsed is None:
        raise SchemaError(f"{key}: expected an integer, got {_short(value)}", source=source)
    if parsed < minimum:
        raise SchemaError(f"{key}: expected an integer >= {minimum}, got {parsed}", source=source)
    return parsed


def plain(value: float) -> float | int:
    """Write whole numbers as ints (``1024`` rather than ``1024.0``) where the reference does."""
    return int(value) if float(value).is_integer() else value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
