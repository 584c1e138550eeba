"""One error type for every bad Galva file, with a one-line message naming the file, field and layer."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from os import PathLike

from pydantic import ValidationError

_MAX_INPUT_REPR = 60
_LEADING_FIELD = re.compile(r"([A-Za-z_]\w*(?:\[[\d.,]+\])?(?:\.[A-Za-z_]\w*(?:\[[\d.,]+\])?)*): ")


class SchemaError(ValueError):
    """A file or object that does not satisfy a Galva contract.

    The message is a single line: ``<source>: <field path>: <what is wrong>``; several problems are joined by ``; ``.
    The same problem on many layers is reported once, e.g. ``layers[0..3,7].tp: ...``.
    """

    def __init__(self, message: str, *, source: str | None = None) -> None:
        self.source = source
        self.detail = message
        super().__init__(f"{source}: {message}" if source else message)


def format_indices(indices: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0..3,7"``."""
    ordered = sorted(set(indices))
    runs: list[str] = []
    start = prev = ordered[0]
    for value in [*ordered[1:], None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        runs.append(str(start) if start == prev else f"{start}..{prev}")
        if value is not None:
            start = prev = value
    return ",".join(runs)


def group_problems(problems: Sequence[tuple[str, int | None, str, str]]) -> list[str]:
    """Merge problems that differ only in a list index.

    Each problem is ``(prefix, index, suffix, message)``, rendered ``prefix[index]suffix: message``
    (``prefix: message`` when index is None).
    """
    order: list[tuple[str, bool, str, str]] = []
    indices: dict[tuple[str, bool, str, str], list[int]] = {}
    for prefix, index, suffix, message in problems:
        key = (prefix, index is not None, suffix, message)
        if key not in indices:
            order.append(key)
            indices[key] = []
        if index is not None:
            indices[key].append(index)
    out = []
    for key in order:
        prefix, indexed, suffix, message = key
        where = f"{prefix}[{format_indices(indices[key])}]{suffix}" if indexed else prefix + suffix
        out.append(f"{where}: {message}" if where else message)
    return out


def _split_location(loc: Sequence[int | str]) -> tuple[str, int | None, str]:
    """Render a pydantic location around its first list index: ``("layers", 3, ".tp")``."""
    prefix, index, suffix = "", None, ""
    for part in loc:
        if isinstance(part, str) and (part.startswith("function-") or part in {"tagged-union", "literal"}):
            continue  # pydantic's union/validator names help nobody
        if isinstance(part, int):
            if index is None:
                index = part
            else:
                suffix += f"[{part}]"
            continue
        if index is None:
            prefix += f".{part}" if prefix else str(part)
        else:
            suffix += f".{part}"
    return prefix, index, suffix


def from_validation_error(err: ValidationError, source: str | PathLike[str] | None = None) -> SchemaError:
    """Turn a pydantic ``ValidationError`` into a one-line :class:`SchemaError`."""
    items = err.errors(include_url=False)
    failed_prefixes = {tuple(item["loc"][:1]) for item in items if len(item["loc"]) > 1}
    problems: list[tuple[str, int | None, str, str]] = []
    for item in items:
        # pydantic also reports "too short" for a list whose items all failed: noise next to the real cause
        if item["type"] == "too_short" and tuple(item["loc"][:1]) in failed_prefixes:
            continue
        msg = str(item["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if item["type"] == "extra_forbidden":
            msg = "unknown key"
        elif item["type"] == "missing":
            msg = "required key is missing"
        elif "input" in item and item["type"] not in {"value_error", "assertion_error"}:
            shown = repr(item["input"])
            if len(shown) > _MAX_INPUT_REPR:
                shown = shown[: _MAX_INPUT_REPR - 3] + "..."
            msg = f"{msg} (got {shown})"
        prefix, index, suffix = _split_location(item["loc"])
        field = _LEADING_FIELD.match(msg) if item["type"] == "value_error" and item["loc"] else None
        if field:  # a nested validator named its field: "layer_types[1].activation: x", not "[1]: activation: x"
            msg = msg[field.end() :]
            if index is None:
                prefix = f"{prefix}.{field[1]}" if prefix else field[1]
            else:
                suffix = f"{suffix}.{field[1]}"
        problems.append((prefix, index, suffix, msg))
    text = "; ".join(group_problems(problems)).replace("\n", " ")
    return SchemaError(text, source=str(source) if source is not None else None)
