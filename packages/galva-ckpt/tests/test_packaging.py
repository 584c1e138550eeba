"""galva-ckpt installs with the dependencies it imports, galva-models only as the ``hf`` extra, and its command."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import galva_ckpt

REQUIRED = {"galva-schema", "torch", "safetensors"}  # progress bars: galva_schema.progress, tqdm if installed
EXTRA_HF = {"galva-models"}  # h2g/g2h ask galva-models for the families' tensor names (imported lazily)
DIST = "galva-ckpt"


def _requirements() -> tuple[set[str], set[str]]:
    required, hf = set(), set()
    for requirement in metadata.requires(DIST) or []:
        name = re.split(r"[ <>=!~;\[]", requirement, maxsplit=1)[0].lower()
        (hf if re.search(r"extra *== *['\"]hf['\"]", requirement) else required).add(name)
    return required, hf


def test_version_matches_the_metadata() -> None:
    assert galva_ckpt.__version__ == metadata.version(DIST)


def test_declared_dependencies() -> None:
    assert _requirements() == (REQUIRED, EXTRA_HF)


def test_every_import_is_declared() -> None:
    """Top-level imports in the source are the standard library, galva_ckpt, or a declared distribution."""
    declared = {"galva_schema", "torch", "safetensors", "galva_models"}
    found = set()
    for path in Path(galva_ckpt.__file__).parent.glob("*.py"):
        found |= set(re.findall(r"^\s*(?:from|import) ([a-z_]+)", path.read_text(), flags=re.M))
    assert found - set(sys.stdlib_module_names) - {"galva_ckpt", "__future__"} == declared


def test_console_script_runs() -> None:
    assert any(ep.name == "galva-ckpt" for ep in metadata.entry_points(group="console_scripts"))
    script = shutil.which("galva-ckpt", path=str(Path(sys.executable).parent))
    assert script is not None
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "h2g" in done.stdout and "g2h" in done.stdout and "info" in done.stdout
