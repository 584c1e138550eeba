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
def test_resolver_installs_no_torch_into_a_fresh_venv(tmp_path):
    """`pip install --dry-run --report` of the package into a bare venv: the resolved set is pydantic's closure."""
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), str(PACKAGE)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
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
