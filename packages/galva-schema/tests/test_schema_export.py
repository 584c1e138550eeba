"""docs/schemas is generated from the pydantic classes and must be current."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import galva_schema
from galva_schema.schemas import export_schemas, json_schemas, render_schemas, stale_schemas

REPO = Path(__file__).resolve().parents[3]
SCHEMAS = REPO / "docs" / "schemas"
COMMAND = ".venv/bin/python tools/export_schemas.py"


def test_committed_schemas_are_current():
    stale = stale_schemas(SCHEMAS)
    assert not stale, f"docs/schemas is stale ({', '.join(stale)}): run `{COMMAND}` and commit the result"


def test_one_schema_per_file_type_with_kind_and_version():
    schemas = json_schemas()
    assert set(schemas) == set(galva_schema.FILE_TYPES)
    for name, schema in schemas.items():
        cls = galva_schema.FILE_TYPES[name]
        assert schema["title"] == cls.__name__
        assert schema["properties"]["kind"]["const"] == cls.KIND
        assert schema["properties"]["schema_version"]["const"] == galva_schema.SCHEMA_VERSION
        assert schema["additionalProperties"] is False  # unknown keys are errors


def test_export_writes_and_detects_staleness(tmp_path):
    written = export_schemas(tmp_path)
    assert sorted(p.name for p in written) == sorted(render_schemas())
    assert stale_schemas(tmp_path) == []
    (tmp_path / "strategy.schema.json").write_text("{}\n")
    (tmp_path / "removed.schema.json").write_text("{}\n")
    assert stale_schemas(tmp_path) == ["strategy.schema.json", "removed.schema.json"]
    export_schemas(tmp_path)  # rewrites the changed file and deletes the one no longer generated
    assert stale_schemas(tmp_path) == [] and not (tmp_path / "removed.schema.json").exists()


def test_tool_script_writes_the_same_files(tmp_path):
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "export_schemas.py"), str(tmp_path)], check=True, capture_output=True
    )
    for name, text in render_schemas().items():
        assert (tmp_path / name).read_text() == text
        json.loads(text)
