"""The generated documentation pages (docs/commands, docs/reference) match the argument parsers and galva-schema's
JSON Schemas as they are now; every relative link in docs/ and the README points at a file that exists."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEN = runpy.run_path(str(ROOT / "tools" / "gen_docs.py"))


def test_generated_pages_are_fresh() -> None:
    stale = GEN["stale_pages"]()
    assert not stale, f"stale generated docs {stale}: run .venv/bin/python tools/gen_docs.py"


def test_one_page_per_command_and_per_file_kind() -> None:
    pages = {p.relative_to(ROOT).as_posix() for p in GEN["render_all"]()}
    for command in ("galva", "galva-profile", "galva-search", "galva-train", "galva-data", "galva-report",
                    "galva-ckpt", "galva-schema"):
        assert f"docs/commands/{command}.md" in pages
    for kind in ("strategy", "hardware_profile", "model_profile", "checkpoint_manifest"):
        assert f"docs/reference/{kind}.md" in pages
    galva = GEN["command_page"]("galva")
    assert "## `galva run`" in galva and "--train-iters" in galva and "--memory" in galva


def test_relative_links_resolve() -> None:
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]
    broken = []
    for source in sources:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", source.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (source.parent / target).exists():
                broken.append(f"{source.relative_to(ROOT)} -> {target}")
    assert not broken, broken
