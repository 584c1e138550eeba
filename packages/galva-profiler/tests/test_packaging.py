"""galva-profiler is installable on its own with the dependencies its later capability needs."""

from __future__ import annotations

import importlib.metadata as metadata
import re

import galva_profiler

EXPECTED = {"galva-schema", "galva-comm", "torch", "numpy"}  # what the later capability needs
DIST = "galva-profiler"


def _requirement_names() -> set[str]:
    return {re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower() for r in metadata.requires(DIST) or []}


def test_version_matches_the_metadata() -> None:
    assert galva_profiler.__version__ == metadata.version(DIST)


def test_declared_dependencies() -> None:
    assert _requirement_names() == EXPECTED
