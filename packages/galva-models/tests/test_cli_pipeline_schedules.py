"""galva-train's pipeline schedule flags: interleaved 1F1B (with Megatron's virtual-stage alias) and ZB-H1."""

from __future__ import annotations

import pytest

from galva_models.cli.config import ConfigError, parse_train_config


def _strategy(*flags: str):  # type: ignore[no-untyped-def]
    base = ["--model", "tiny-llama", "--num-layers", "8", "--seq-length", "32", "--global-batch-size", "8"]
    return parse_train_config([*base, *flags], world_size=4).strategy


def test_interleaved_and_zero_bubble_flags() -> None:
    s = _strategy("--pp", "2", "--chunks", "4", "--num-virtual-stages-per-pipeline-rank", "2")
    assert s.pipeline_schedule.value == "interleaved-1f1b" and s.virtual_stages == 2  # v > 1 implies interleaved
    assert s.pp_division == (2, 2, 2, 2) and s.stage_layers(1) == (2, 3, 6, 7)
    s = _strategy("--pp", "4", "--chunks", "4", "--pipeline-schedule", "interleaved-1f1b", "--virtual-stages", "2")
    assert s.num_chunks == 8
    s = _strategy("--pp", "2", "--chunks", "4", "--pipeline-schedule", "zb-h1")
    assert s.pipeline_schedule.value == "zb-h1" and s.virtual_stages == 1


def test_bad_schedule_flags_are_one_line() -> None:
    with pytest.raises(ConfigError, match="multiple of pp"):
        _strategy("--pp", "4", "--chunks", "2", "--virtual-stages", "2")
    with pytest.raises(ConfigError, match="virtual_stages"):
        _strategy("--pp", "2", "--chunks", "4", "--pipeline-schedule", "zb-h1", "--virtual-stages", "2")
    with pytest.raises(ConfigError, match="more than the model's 8 layers"):
        _strategy("--pp", "4", "--chunks", "4", "--virtual-stages", "3")
