"""docs/migrating.md's commands run as written on the reference system's (Galvatron's) own files (issue #22).

``tests/data/galvatron/`` holds Galvatron's files unchanged: its LLaMA-7B model profile from
``galvatron/models/llama_hf/configs/`` and its 1x8-GPU hardware profile at commit 14f5972 (the memory file mixes plain
and Megatron-SP ``_sp`` sections), and the LLaMA-2-7B profile and strategy from ``galvatron/models/gpt/configs/`` at
its HEAD. Every galva-search / galva-schema / ``python -c`` command of the page runs in that directory, in page order,
with only a trailing ``...`` (the reader's own flags) dropped; a command with ``...`` elsewhere is a template and is
skipped. The hardware directory is where the page names it, ``path/to/hardware_configs``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "migrating.md"
DATA = ROOT / "tests" / "data" / "galvatron"
RUNNABLE = ("galva-search ", "galva-schema ", "python -c ")  # the rest needs torchrun, a GPU or Galvatron
HARDWARE_FILES = ("allreduce_bandwidth_", "p2p_bandwidth_", "sp_time_", "overlap_coefficient")


def doc_commands() -> list[str]:
    """The shell commands of the page's ``bash`` blocks, continuation lines joined, trailing ``...`` dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s\.\.\.(?=\s*(#.*)?$)", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_the_pages_commands_run_on_galvatrons_own_files(tmp_path: Path) -> None:
    for path in DATA.iterdir():
        shutil.copy(path, tmp_path / path.name)
    hardware_dir = tmp_path / "path" / "to" / "hardware_configs"
    hardware_dir.mkdir(parents=True)
    for path in DATA.iterdir():
        if path.name.startswith(HARDWARE_FILES):
            shutil.copy(path, hardware_dir / path.name)
    shutil.copy(ROOT / "examples" / "llama-7b-8gpu" / "model.json", tmp_path / "model.json")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    ran = []
    for command in doc_commands():
        if not command.startswith(RUNNABLE) or "..." in command:
            continue
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"
        ran.append((command, done.stdout))
    searches = [(c, out) for c, out in ran if c.startswith("galva-search")]
    # the hardware directory search, both model-profile searches, the python conversion, the two strategy conversions
    assert len(searches) == 3 and len(ran) == 6, [c for c, _ in ran]
    mixed = next(out for c, out in searches if "hidden4096_head32_seqlen2048" in c)
    sp_only = next(out for c, out in searches if "llama2-7b_all" in c)
    assert "Megatron-SP" not in mixed and "Megatron-SP" in sp_only  # plain sections where both kinds are present
    assert "of 32616 MiB usable (budget 34332 MiB)" in mixed  # 36GB = 36e9 bytes = 34332 MiB, 5% kept free
    assert (tmp_path / "hardware.json").is_file() and (tmp_path / "galvatron_config_out.json").is_file()


def test_megatron_sp_reads_the_sp_sections_of_a_mixed_file(tmp_path: Path) -> None:
    """The page's --megatron-sp: the same mixed file, its ``_sp`` sections, a Megatron-SP search."""
    command = [
        "--model-profile", str(DATA / "computation_profiling_bf16_hidden4096_head32_seqlen2048.json"),
        "--model-profile", str(DATA / "memory_profiling_bf16_hidden4096_head32_seqlen2048.json"),
        "--num-layers", "32", "--hidden-size", "4096", "--seq-length", "2048",
        "--hardware-profile", str(DATA), "--nodes", "1", "--gpus-per-node", "8", "--memory", "36GiB",
        "--global-batch-size", "64", "--megatron-sp",
    ]
    done = subprocess.run([str(Path(sys.executable).parent / "galva-search"), *command], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Megatron-SP" in done.stdout and "budget 36864 MiB" in done.stdout  # 36GiB = 36 * 1024 MiB
