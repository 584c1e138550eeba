"""--lr-decay-style: the schedule's factors, and the learning rate galva-train actually applies step by step."""

from __future__ import annotations

import json
import math

import pytest
import torch.distributed as dist

from galva_hp import OptimConfig, lr_factor
from galva_models.cli.train import main as train_main

WARMUP, TOTAL, MIN_RATIO = 2, 6, 0.1


def expected(style: str, step: int) -> float:
    """Megatron's schedules written out: linear warm-up, then decay to MIN_RATIO at TOTAL (constant: none)."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = (step - WARMUP) / (TOTAL - WARMUP)
    decay = {"cosine": 0.5 * (1 + math.cos(math.pi * progress)), "linear": 1 - progress, "constant": 1.0}[style]
    return 1.0 if style == "constant" else MIN_RATIO + (1 - MIN_RATIO) * decay


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_factors(style):
    factor = lr_factor(OptimConfig(warmup_steps=WARMUP, total_steps=TOTAL, min_lr_ratio=MIN_RATIO, decay_style=style))
    assert [factor(t) for t in range(TOTAL + 2)] == pytest.approx([expected(style, min(t, TOTAL)) for t in range(8)])


def test_unknown_style():
    with pytest.raises(ValueError, match="lr decay style 'step' is not one of cosine, linear, constant"):
        OptimConfig(decay_style="step")


@pytest.mark.parametrize("style", ["linear", "constant"])
def test_galva_train_applies_the_style(style, tmp_path, monkeypatch):
    """One gloo rank trains tiny-gpt2 for TOTAL steps; the logged lr (the one each step used) follows the style."""
    from galva_comm.testing import free_port

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    metrics = tmp_path / "metrics.jsonl"
    argv = [
        "--model", "tiny-gpt2", "--seq-length", "16", "--global-batch-size", "2", "--fp32", "--no-progress",
        "--train-iters", str(TOTAL), "--lr", "1e-3", "--min-lr", str(1e-3 * MIN_RATIO), "--lr-warmup-iters",
        str(WARMUP), "--lr-decay-style", style, "--metrics-jsonl", str(metrics),
    ]  # fmt: skip
    try:
        assert train_main(argv) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    lrs = [json.loads(line)["lr"] for line in metrics.read_text().splitlines()]
    assert lrs == pytest.approx([1e-3 * expected(style, t) for t in range(TOTAL)], rel=1e-12)
