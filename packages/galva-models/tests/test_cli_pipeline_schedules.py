"""galva-train's pipeline schedule flags: interleaved 1F1B (with Megatron's virtual-stage alias) and ZB-H1."""

from __future__ import annotations

import pytest

from galva_models.cli.config import ConfigError, parse_train_config
from galva_schema import DataParallelType, PipelineSchedule


def _strategy(*flags: str):  # type: ignore[no-untyped-def]
    base = ["--model", "tiny-llama", "--num-layers", "8", "--seq-length", "32", "--global-batch-size", "8"]
    return parse_train_config([*base, *flags], world_size=4).strategy


def test_global_flags_and_the_reference_names_map_to_one_uniform_plan() -> None:
    """The reference runtime's flags (--chunks, --pipeline-type pipedream_flush, --sdp) give the plan they name;
    strided tp is honoured (the reference forced consecutive groups)."""
    flags = ["--pp", "2", "--tp", "2", "--tp-consecutive", "0", "--sdp", "--chunks", "4", "--checkpoint",
             "--pipeline-type", "pipedream_flush", "--vocab-tp", "4", "--num-layers", "4", "--fp32"]  # fmt: skip
    base = ["--model", "tiny-llama", "--seq-length", "32", "--global-batch-size", "16"]
    s = parse_train_config([*base, *flags], world_size=8).strategy
    assert (s.pp, s.pp_division, s.num_micro_batches) == (2, (2, 2), 4)
    assert s.pipeline_schedule is PipelineSchedule.ONE_F_ONE_B
    assert all(layer.tp == 2 and not layer.tp_consecutive and layer.checkpoint for layer in s.layers)
    assert s.default_dp_type is DataParallelType.ZERO3 and s.vocab.tp == 4
    assert s.layer_summary(0) == "2-2-2f-c"


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
