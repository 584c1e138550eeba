#!/usr/bin/env python3
"""Regenerate docs/schemas/<name>.schema.json from galva_schema's pydantic classes (never edit those by hand).

    .venv/bin/python tools/export_schemas.py [DIR]

A test (packages/galva-schema/tests/test_schema_export.py) fails when the committed files are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from galva_schema.schemas import export_schemas

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "docs" / "schemas"


def main(argv: list[str]) -> int:
    directory = Path(argv[0]) if argv else DEFAULT_DIR
    for path in export_schemas(directory):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
