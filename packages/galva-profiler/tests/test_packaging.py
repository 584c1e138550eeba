"""galva-profiler declares what it imports: the core for hardware profiling, an extra for model profiling."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
from pathlib import Path

import galva_profiler

DIST = "galva-profiler"
CORE = {"galva-schema", "galva-comm", "torch", "numpy"}
MODEL_EXTRA = {"galva-hp", "galva-models", "galva-search", "transformers"}


def _requirements() -> list[str]:
    return metadata.requires(DIST) or []


def _name(requirement: str) -> str:
    return re.split(r"[ <>=!~;\[]", requirement, maxsplit=1)[0].lower()


def test_version_matches_the_metadata() -> None:
    assert galva_profiler.__version__ == metadata.version(DIST)


def test_declared_dependencies() -> None:
    core = {_name(r) for r in _requirements() if "extra" not in r}
    extra = {_name(r) for r in _requirements() if re.search(r"extra == ['\"]model['\"]", r)}
    assert core == CORE
    assert extra == MODEL_EXTRA


def test_console_script_is_installed() -> None:
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts["galva-profile"] == "galva_profiler.cli:main"
    assert (Path(sys.executable).parent / "galva-profile").is_file()  # the venv's bin, next to its python
