"""galva-ckpt installs with the dependencies it imports (none of them galva-models), and its command."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import galva_ckpt

REQUIRED = {"galva-schema", "torch", "safetensors"}  # progress bars: galva_schema.progress, tqdm if installed
DIST = "galva-ckpt"


def _requirements() -> set[str]:
    return {re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower() for r in metadata.requires(DIST) or []}


def test_version_matches_the_metadata() -> None:
    assert galva_ckpt.__version__ == metadata.version(DIST)


def test_declared_dependencies() -> None:
    assert _requirements() == REQUIRED


def test_every_import_is_declared() -> None:
    """Top-level imports in the source are the standard library, galva_ckpt, or a declared distribution."""
    declared = {"galva_schema", "torch", "safetensors"}
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


def test_the_model_layouts_come_from_an_entry_point_galva_models_declares() -> None:
    """h2g / g2h find the families' tensor names through an entry point, so the dependency runs one way."""
    from galva_ckpt.layout import LAYOUT_GROUP, model_layout

    (provider,) = metadata.entry_points(group=LAYOUT_GROUP)
    assert provider.dist is not None and provider.dist.name == "galva-models"
    layout = model_layout({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                           "num_attention_heads": 4, "vocab_size": 128}, "config.json")  # fmt: skip
    assert [m.name for m in layout.modules] == ["embedding", "layers.0", "layers.1", "head"]
