"""Hardware profiles measured once per test session: each is a real ``galva-profile hardware`` launch (torchrun, a
quick sweep; 10-40 s on a loaded 2-core machine), and test_cli.py and test_check.py read the same files."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

PROFILE = [sys.executable, "-m", "galva_profiler.cli"]
HW_FLAGS = ["--sizes-mib", "0.0625,0.125", "--bandwidth-mib", "0.125", "--p2p-mib", "0.125", "--timing-span", "0"]
HW_FLAGS += ["--warmup", "0", "--repetitions", "2", "--quick", "--quiet"]
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
if "PYTHONPATH" in os.environ:  # a source checkout put first on the path: its commands run that code, not the install
    ENV["PYTHONPATH"] = os.environ["PYTHONPATH"]


@pytest.fixture(scope="session")
def hardware_profile(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Path, str]]:
    """``hardware_profile(world)``: the directory holding ``hw{world}.json`` (and the reference system's files under
    ``ref{world}/``) and the command's stdout, measured on the first call for that world size."""
    measured: dict[int, tuple[Path, str]] = {}

    def measure(world: int) -> tuple[Path, str]:
        if world not in measured:
            root = tmp_path_factory.mktemp(f"hw{world}")
            argv = [*PROFILE, "hardware", "--nproc-per-node", str(world), *HW_FLAGS, "-o", f"hw{world}.json",
                    "--galvatron-dir", f"ref{world}"]  # fmt: skip
            done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=600, env=ENV)
            assert done.returncode == 0, done.stderr[-2000:]
            measured[world] = root, done.stdout
        return measured[world]

    return measure
