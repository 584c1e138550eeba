"""Strategy: derived properties and validation of runnable plans."""

from __future__ import annotations

import pytest

from galva_schema import DataParallelType, LayerStrategy, SchemaError, Strategy, even_division


def _plan(**fields):
    base = {
        "world_size": 8,
        "pp": 2,
        "global_batch_size": 32,
        "num_micro_batches": 4,
        "default_dp_type": "zero2",
        "layers": [{"tp": 1}] * 3
        + [{"tp": 2, "tp_consecutive": False, "dp_type": "zero3", "checkpoint": True}]
        + [{"tp": 4, "ulysses": True}] * 2,
        "vocab": {"tp": 2, "dp_type": "zero3"},
    }
    return Strategy.from_dict({**base, **fields}, source="plan.json")


def test_derived_properties():
    plan = _plan()
    assert plan.num_layers == 6
    assert plan.ranks_per_stage == 4
    assert plan.micro_batch_size == 8
    assert plan.pp_division == (3, 3)  # even split by default
    assert plan.layer_stages == (0, 0, 0, 1, 1, 1)
    assert list(plan.stage_layers(1)) == [3, 4, 5]
    assert [plan.layer_dp(i) for i in range(6)] == [4, 4, 4, 2, 1, 1]
    assert plan.layer_dp_type(0) is DataParallelType.ZERO2
    assert plan.layer_dp_type(3) is DataParallelType.ZERO3
    assert plan.vocab_dp == 2
    assert plan.vocab_dp_type is DataParallelType.ZERO3
    assert plan.layers[4].tp_degree == 1 and plan.layers[4].sp_degree == 4
    assert plan.layers[3].tp_degree == 2 and plan.layers[3].sp_degree == 1
    assert plan.layer_summary(0) == "2-1-4z2"
    assert plan.layer_summary(3) == "2-2-2f-c"
    assert plan.layer_summary(4) == "2-4*-1z2-sp"
    with pytest.raises(IndexError):
        plan.stage_layers(2)


def test_even_division_puts_the_remainder_on_the_last_stage():
    assert even_division(32, 3) == [10, 10, 12]
    assert even_division(7, 1) == [7]


def test_uniform_and_round_trip_through_dict(tmp_path):
    plan = Strategy.uniform(world_size=4, num_layers=5, global_batch_size=8, layer=LayerStrategy(tp=2), pp=1)
    assert plan.pp_division == (5,)
    path = plan.save(tmp_path / "plan.json")
    assert Strategy.load(path) == plan


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"pp": 3}, "plan.json: pp: 3 does not divide world_size 8"),
        ({"pp_division": [2, 2]}, "plan.json: pp_division: sums to 4 layers but the strategy has 6 layers"),
        ({"num_micro_batches": 5}, "global_batch_size: 32 is not divisible by num_micro_batches 5"),
        ({"global_batch_size": 2, "num_micro_batches": 1}, "layers[0..2]: a micro-batch of 2 samples cannot be split"),
        ({"vocab": {"tp": 8}}, "vocab.tp: 8 is larger than the 4 ranks of a pipeline stage"),
    ],
)
def test_unrunnable_plans_name_the_field(fields, expected):
    with pytest.raises(SchemaError) as info:
        _plan(**fields)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_strategy_rejects_nan_and_infinity():
    with pytest.raises(SchemaError, match="global_batch_size"):
        _plan(global_batch_size=float("nan"))


def test_interleaved_chunks_are_derived_from_one_division():
    plan = _plan(pipeline_schedule="interleaved-1f1b", virtual_stages=3)  # 6 layers, pp 2 -> 6 chunks of 1
    assert plan.num_chunks == 6 and plan.pp_division == (1,) * 6
    assert plan.stage_chunks(0) == (0, 2, 4) and plan.stage_chunks(1) == (1, 3, 5)
    assert plan.layer_stages == (0, 1, 0, 1, 0, 1)
    assert plan.stage_layers(1) == (1, 3, 5)
    uneven = _plan(pipeline_schedule="interleaved-1f1b", virtual_stages=2, pp_division=[1, 2, 2, 1])
    assert uneven.layer_chunks == (0, 1, 1, 2, 2, 3)
    assert uneven.stage_layers(0) == (0, 3, 4) and list(uneven.chunk_layers(1)) == [1, 2]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"virtual_stages": 2}, "virtual_stages: 2 model chunks per stage need pipeline_schedule interleaved-1f1b"),
        ({"pipeline_schedule": "interleaved-1f1b"}, "virtual_stages: interleaved-1f1b needs 2 or more"),
        ({"pipeline_schedule": "interleaved-1f1b", "virtual_stages": 2, "num_micro_batches": 2,
          "global_batch_size": 16, "pp": 4, "world_size": 8},
         "num_micro_batches: interleaved-1f1b needs a multiple of pp 4, got 2"),
        ({"pipeline_schedule": "interleaved-1f1b", "virtual_stages": 2, "pp_division": [3, 3]},
         "pp_division: has 2 chunks but pp x virtual_stages is 2 x 2 = 4"),
        ({"pipeline_schedule": "zb-h1", "virtual_stages": 2}, "need pipeline_schedule interleaved-1f1b, not zb-h1"),
        ({"pipeline_schedule": "interleaved-1f1b", "virtual_stages": 4},
         "pp_division: sums to 8 layers but the strategy has 6 layers"),
    ],
)
def test_schedule_problems_name_the_field(fields, expected):
    with pytest.raises(SchemaError, match=expected.replace("(", r"\(")):
        _plan(**fields)


def test_zero_bubble_keeps_one_chunk_per_stage():
    plan = _plan(pipeline_schedule="zb-h1")
    assert plan.num_chunks == 2 and plan.stage_layers(0) == (0, 1, 2)
