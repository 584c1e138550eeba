"""JSON Schemas of the Galva file types, generated from the pydantic classes (never written by hand).

``tools/export_schemas.py`` and ``galva-schema export-schemas`` write them to ``docs/schemas/<name>.schema.json``;
a test regenerates them in memory and fails when the committed files are stale.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from galva_schema.files import write_json_atomic

SCHEMA_SUFFIX = ".schema.json"


def json_schemas() -> dict[str, dict[str, Any]]:
    """``{name: JSON Schema}`` for every class in :data:`galva_schema.FILE_TYPES`."""
    from galva_schema import FILE_TYPES  # the package imports this module's users, not the reverse

    out = {}
    for name, cls in FILE_TYPES.items():
        schema = cls.model_json_schema(by_alias=True, mode="validation")
        out[name] = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": name + SCHEMA_SUFFIX, **schema}
    return out


def render_schemas() -> dict[str, str]:
    """``{file name: file text}``: exactly what :func:`export_schemas` writes."""
    return {name + SCHEMA_SUFFIX: json.dumps(schema, indent=2) + "\n" for name, schema in json_schemas().items()}


def export_schemas(directory: str | os.PathLike[str]) -> list[Path]:
    """Write every schema into ``directory`` and remove stale ``*.schema.json`` files; returns the written paths."""
    directory = Path(directory)
    rendered = render_schemas()
    if directory.is_dir():
        for old in directory.glob("*" + SCHEMA_SUFFIX):
            if old.name not in rendered:
                old.unlink()
    return [write_json_atomic(directory / name, json.loads(text)) for name, text in rendered.items()]


def stale_schemas(directory: str | os.PathLike[str]) -> list[str]:
    """File names under ``directory`` that are missing, different from the generated text, or no longer generated."""
    directory = Path(directory)
    rendered = render_schemas()
    stale = [name for name, text in rendered.items() if _read(directory / name) != text]
    if directory.is_dir():
        stale += sorted(p.name for p in directory.glob("*" + SCHEMA_SUFFIX) if p.name not in rendered)
    return stale


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
