"""galva-schema depends on pydantic only: `pip install galva-schema` never pulls torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from importlib.metadata import requires
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower() for req in requirements}


def test_declared_and_installed_dependencies_are_pydantic_only():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    declared = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]["dependencies"]
    assert _names(declared) == {"pydantic"}
    installed = [req for req in requires("galva-schema") or [] if "extra ==" not in req]
    assert _names(installed) == {"pydantic"}


def test_importing_galva_schema_imports_no_torch():
    code = "import sys, galva_schema, galva_schema.reference, galva_schema.cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.slow
def test_resolver_installs_no_torch_into_a_fresh_venv(tmp_path, repo_wheels):
    """`pip install --dry-run --report` of the package (the wheel pip builds from it, conftest.py) into a bare venv:
    the resolved set is pydantic's closure. pip runs from this environment against the venv's interpreter
    (``--python``): the venv needs no pip of its own."""
    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    (wheel,) = repo_wheels("galva-schema")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet", "--report",
         str(report), str(wheel)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    if result.returncode != 0 and re.search(
        r"No matching distribution|Could not find a version|network", result.stderr
    ):
        pytest.skip(f"no package index reachable: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr
    resolved = {
        item["metadata"]["name"].lower().replace("_", "-") for item in json.loads(report.read_text())["install"]
    }
    assert "galva-schema" in resolved and "pydantic" in resolved
    assert not resolved & {"torch", "numpy", "scipy", "nvidia-cuda-runtime-cu12"}, resolved
    assert resolved <= {
        "galva-schema",
        "pydantic",
        "pydantic-core",
        "annotated-types",
        "typing-extensions",
        "typing-inspection",
    }, resolved


def test_every_public_name_resolves_from_the_module_the_table_names():
    """The package imports its names on first use: each name of ``__all__`` has a home in the table, is what that
    module defines, and is what type checkers are shown (the ``if TYPE_CHECKING`` imports)."""
    import ast

    import galva_schema

    assert set(galva_schema._HOMES) == set(galva_schema.__all__)
    for name, module in galva_schema._HOMES.items():
        home = __import__(f"galva_schema.{module}", fromlist=[name])
        assert getattr(galva_schema, name) is getattr(home, name), name
    tree = ast.parse(Path(galva_schema.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    shown = {(n.module, a.name) for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert shown == {(f"galva_schema.{m}", name) for name, m in galva_schema._HOMES.items()}
    with pytest.raises(AttributeError, match="no attribute 'Strategie'"):
        galva_schema.Strategie  # noqa: B018


def test_reading_a_profile_builds_no_checkpoint_or_run_check_model():
    """``galva-search`` pays at start-up only for the file types it reads and writes (models are built lazily)."""
    code = (
        "import sys, galva_schema; galva_schema.HardwareProfile, galva_schema.ModelProfile, galva_schema.Strategy; "
        "print(sorted(m for m in ('galva_schema.checkpoint', 'galva_schema.run_check') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
