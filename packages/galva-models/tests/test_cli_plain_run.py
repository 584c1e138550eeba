"""galva-train typed plainly, without torchrun or --nproc-per-node: it trains as the one rank its help promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC")}


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "galva_models.cli.train", "--model", "tiny-llama", "--no-progress", *args]
    return subprocess.run(command, capture_output=True, text=True, env=_plain_env(), timeout=600)


def test_without_a_launcher_it_trains_on_one_rank(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    done = _train("--train-iters", "2", "--fp32", "--metrics-jsonl", str(metrics))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "tiny-llama on 1 rank:" in done.stderr.splitlines()[0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["loss"] == r["loss"] for r in records)  # finite numbers, not NaN


def test_a_larger_world_without_a_launcher_is_one_line(tmp_path):
    done = _train("--world-size", "2", "--train-iters", "2")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "galva-train: error: a world of 2 ranks needs 2 processes: add --nproc-per-node 2, or start galva-train "
        "with torchrun"
    )
