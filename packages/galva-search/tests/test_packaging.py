"""galva-search declares every distribution it imports, and nothing of torch."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import galva_search

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PACKAGE = Path(__file__).resolve().parents[1]
SOURCES = PACKAGE / "src" / "galva_search"


def _declared() -> set[str]:
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    return {re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower() for r in project["dependencies"]}


def _imported_top_level() -> set[str]:
    found: set[str] = set()
    for path in SOURCES.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def test_every_imported_distribution_is_declared() -> None:
    imported = _imported_top_level()
    first_party = {name.replace("_", "-") for name in imported if name.startswith("galva_")} - {"galva-search"}
    assert first_party == {"galva-schema", "galva-comm"}
    assert first_party | {"numpy"} <= _declared()
    assert "torch" not in imported and not any(name.startswith("torch") for name in _declared())


def test_version_matches_the_project_file() -> None:
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    assert galva_search.__version__ == project["version"]
