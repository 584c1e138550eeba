"""The command end to end: profiles written, fed straight to galva-search; bad input is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from galva_schema import HardwareProfile, ModelProfile, Strategy

PROFILE = [sys.executable, "-m", "galva_profiler.cli"]
HW_FLAGS = ["--sizes-mib", "0.0625,0.125", "--bandwidth-mib", "0.125", "--p2p-mib", "0.125"]
HW_FLAGS += ["--warmup", "0", "--repetitions", "2", "--quick", "--quiet"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("galva-profile: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_unknown_preset(tmp_path: Path) -> None:
    line = _one_error_line(_run([*PROFILE, "model", "--preset", "tiny-lama", "--seq-lengths", "16"], tmp_path))
    assert "unknown model preset 'tiny-lama'" in line
    assert list(tmp_path.iterdir()) == []


def test_hardware_sweep_on_a_world_of_one(tmp_path: Path) -> None:
    line = _one_error_line(_run([*PROFILE, "hardware", *HW_FLAGS], tmp_path))
    assert "at least 2 ranks" in line
    line = _one_error_line(_run([*PROFILE, "hardware", "--nproc-per-node", "1", *HW_FLAGS], tmp_path))
    assert "at least 2 ranks" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["model", "hardware"])
def test_unwritable_output_fails_before_measuring(tmp_path: Path, command: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    output = str(blocker / "profile.json")  # a file's child: never writable, even for root
    if command == "model":
        args = [*PROFILE, "model", "--preset", "tiny-llama", "--seq-lengths", "16", "-o", output]
    else:
        args = [*PROFILE, "hardware", "--nproc-per-node", "2", *HW_FLAGS, "-o", output]
    line = _one_error_line(_run(args, tmp_path))
    assert "--output" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_several_lengths_need_a_seq_placeholder(tmp_path: Path) -> None:
    args = [*PROFILE, "model", "--preset", "tiny-gpt2", "--seq-lengths", "16,32", "-o", "x.json"]
    assert "{seq}" in _one_error_line(_run(args, tmp_path))


@pytest.mark.distributed
@pytest.mark.slow
def test_profiles_feed_galva_search(tmp_path: Path) -> None:
    hw = _run(
        [*PROFILE, "hardware", "--nproc-per-node", "2", *HW_FLAGS, "-o", "hw.json", "--galvatron-dir", "ref"], tmp_path
    )
    assert hw.returncode == 0, hw.stderr[-2000:]
    assert "hardware profile: 2 ranks" in hw.stdout
    model_args = ["--preset", "tiny-gpt2", "--seq-lengths", "16", "--batch-sizes", "1,2", "--max-tp", "2"]
    model = _run([*PROFILE, "model", *model_args, "--repetitions", "1", "-o", "m.json", "--report", "r.json"], tmp_path)
    assert model.returncode == 0, model.stderr[-2000:]
    assert "[" in model.stderr  # the progress bar
    assert HardwareProfile.load(tmp_path / "hw.json").cluster.world_size == 2
    assert ModelProfile.load(tmp_path / "m.json").constraints is not None
    from galva_search.cli import main as search

    argv = ["--hardware-profile", str(tmp_path / "hw.json"), "--model-profile", str(tmp_path / "m.json")]
    argv += ["--memory", "4GiB", "--global-batch-size", "4", "--output", str(tmp_path / "plan.json"), "--quiet"]
    assert search(argv) == 0
    assert Strategy.load(tmp_path / "plan.json").world_size == 2
