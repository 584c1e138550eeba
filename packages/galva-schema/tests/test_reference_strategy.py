"""Reference (Galvatron) strategy files: reading, writing, round trips, defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from galva_schema import DataParallelType, PipelineSchedule, Precision, SchemaError, Strategy
from galva_schema.reference import read_galvatron_strategy, to_galvatron_strategy, write_galvatron_strategy
from galva_schema.reference.strategy import KNOWN_KEYS, strategy_file_name

STRATEGIES = Path(__file__).parent / "data" / "galvatron" / "strategies"
ULYSSES = STRATEGIES / "galvatron_config_llama-7b_1nodes_8gpus_per_node_36GB_bf16_ulysses.json"
PIPELINE = STRATEGIES / "galvatron_config_gpt-2.7b_1nodes_8gpus_per_node_40GB_bf16_example.json"


def _raw(path: Path) -> dict:
    return json.loads(path.read_text())


def test_ulysses_file():
    plan = read_galvatron_strategy(ULYSSES, world_size=8)
    assert plan.num_layers == 32 and plan.pp == 1 and plan.pp_division == (32,)
    assert plan.pipeline_schedule is PipelineSchedule.ONE_F_ONE_B  # pipedream_flush
    assert plan.default_dp_type is DataParallelType.ZERO2
    assert plan.global_batch_size == 16 and plan.num_micro_batches == 1
    first, last = plan.layers[0], plan.layers[31]
    assert (first.tp, first.ulysses, first.dp_type, first.checkpoint) == (1, False, DataParallelType.ZERO3, True)
    # tp_sizes_enc holds the Ulysses degree when use_sp = 1
    assert (last.tp, last.ulysses, last.dp_type, last.checkpoint) == (4, True, None, False)
    assert last.sp_degree == 4 and last.tp_degree == 1 and plan.layer_dp(31) == 2
    assert plan.vocab.tp == 2 and plan.vocab.sp and plan.vocab.dp_type is DataParallelType.ZERO3
    assert plan.layer_summary(0) == "1-1-8f-c" and plan.layer_summary(31) == "1-4*-2z2-sp"
    assert plan.mixed_precision is Precision.BF16 and not plan.megatron_sp


def test_pipeline_file():
    plan = read_galvatron_strategy(PIPELINE, world_size=8)
    assert plan.pp == 2 and plan.pp_division == (15, 17) and plan.num_micro_batches == 4
    assert plan.pipeline_schedule is PipelineSchedule.GPIPE
    assert plan.layer_stages[14:16] == (0, 1)
    assert [plan.layers[i].tp for i in (0, 15, 16, 31)] == [1, 1, 2, 2]
    # flags only matter for 1 < tp < W/pp = 4: layers 20..23 (tp 2) keep their strided layout
    assert [plan.layers[i].tp_consecutive for i in (19, 20, 23, 24)] == [True, False, False, True]
    assert all(layer.dp_type is DataParallelType.ZERO3 for layer in plan.layers)
    assert [plan.layers[i].checkpoint for i in (7, 8, 15, 16)] == [False, True, True, False]
    assert plan.layer_summary(20) == "2-2-2f" and plan.layer_summary(16) == "2-2*-2f"


@pytest.mark.parametrize("path", [ULYSSES, PIPELINE], ids=["ulysses", "pipeline"])
def test_reference_to_galva_to_reference_keeps_every_key(path):
    original = _raw(path)
    written = to_galvatron_strategy(read_galvatron_strategy(path, world_size=8))
    for key, value in original.items():
        assert written[key] == value, key
    # keys the writer adds: the ones 14f5972 needs (spec §11.1) and the world size
    assert written["cp_sizes_enc"] == ",".join(["1"] * 32) and written["vcp"] == 1 and written["world_size"] == 8
    assert set(written) == KNOWN_KEYS


@pytest.mark.parametrize("path", [ULYSSES, PIPELINE], ids=["ulysses", "pipeline"])
def test_galva_to_reference_to_galva_is_identity(path, tmp_path):
    plan = read_galvatron_strategy(path, world_size=8)
    out = write_galvatron_strategy(plan, tmp_path / "galvatron_config.json")
    assert read_galvatron_strategy(out, world_size=8) == plan
    # and through Galva's own file format
    assert Strategy.load(plan.save(tmp_path / "plan.json")) == plan


def test_missing_optional_keys_get_reference_defaults():
    minimal = {"pp_deg": 2, "tp_sizes_enc": "1,1,2,2,2", "dp_types_enc": "0,0,0,1,0", "global_bsz": 32}
    plan = read_galvatron_strategy(minimal, world_size=8)
    assert plan.pp_division == (2, 3)  # even split, remainder on the last stage
    assert plan.pipeline_schedule is PipelineSchedule.GPIPE
    assert plan.default_dp_type is DataParallelType.DDP
    assert plan.num_micro_batches == 2  # the reference "auto": ceil(32 / (8/2) / 4)
    assert not any(layer.ulysses or layer.checkpoint for layer in plan.layers)
    assert all(layer.tp_consecutive for layer in plan.layers)
    assert plan.vocab.tp == 1 and not plan.vocab.sp and plan.vocab.dp_type is None
    assert read_galvatron_strategy({**minimal, "pp_deg": 1}, world_size=8).num_micro_batches == 1


def test_global_batch_size_fallback_and_world_size_from_file():
    data = {"pp_deg": 1, "tp_sizes_enc": "2,2", "dp_types_enc": "0,0", "world_size": 4}
    with pytest.raises(SchemaError, match="global_bsz: missing"):
        read_galvatron_strategy(data, world_size=None, source="cfg.json")
    plan = read_galvatron_strategy(data, world_size=None, global_batch_size=8)
    assert plan.world_size == 4 and plan.global_batch_size == 8
    with pytest.raises(SchemaError, match="world_size: the file says 4 ranks but the run has 8"):
        read_galvatron_strategy({**data, "global_bsz": 8}, world_size=8)


def test_all_ones_context_parallel_is_accepted():
    data = {**_raw(PIPELINE), "cp_sizes_enc": ",".join(["1"] * 32), "vcp": 1}
    assert read_galvatron_strategy(data, world_size=8) == read_galvatron_strategy(PIPELINE, world_size=8)


def test_normalisations_of_meaningless_flags():
    data = {
        "pp_deg": 1,
        "tp_sizes_enc": "1,8,2",
        "tp_consecutive_flags": "0,0,0",
        "use_sp": "1,0,0",
        "dp_types_enc": "0,0,0",
        "global_bsz": 8,
        "vtp": 1,
        "vsp": 1,
    }
    plan = read_galvatron_strategy(data, world_size=8)
    # consecutive flags are forced to 1 for tp in {1, W/pp}; Ulysses of degree 1 is no parallelism
    assert [layer.tp_consecutive for layer in plan.layers] == [True, True, False]
    assert not plan.layers[0].ulysses and not plan.vocab.sp
    written = to_galvatron_strategy(plan)
    assert written["tp_consecutive_flags"] == "1,1,0" and written["use_sp"] == "0,0,0" and written["vsp"] == 0


def test_explicit_dp_type_other_than_default_cannot_be_written():
    plan = Strategy.from_dict(
        {
            "world_size": 2,
            "global_batch_size": 4,
            "default_dp_type": "ddp",
            "layers": [{}, {"dp_type": "zero2"}, {"dp_type": "zero2"}, {"dp_type": "ddp"}],
        }
    )
    with pytest.raises(SchemaError) as info:
        to_galvatron_strategy(plan)
    assert str(info.value).startswith("layers[1..2].dp_type: zero2 differs from default_dp_type ddp")
    # an explicit type equal to the default is just the default
    same = Strategy.from_dict({"world_size": 2, "global_batch_size": 4, "layers": [{}, {"dp_type": "ddp"}]})
    assert to_galvatron_strategy(same)["dp_types_enc"] == "0,0"


@pytest.mark.parametrize(("schedule", "virtual"), [("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_schedules_the_reference_cannot_run_are_refused_in_one_line(schedule, virtual):
    plan = Strategy.from_dict(
        {"world_size": 4, "pp": 2, "global_batch_size": 8, "num_micro_batches": 4, "layers": [{}] * 4,
         "pipeline_schedule": schedule, "virtual_stages": virtual}
    )
    with pytest.raises(SchemaError) as info:
        to_galvatron_strategy(plan)
    assert str(info.value) == (
        f"pipeline_schedule: {schedule} cannot be written as a reference strategy; "
        "the reference runs only gpipe and 1f1b (pipedream_flush)"
    )


def test_reader_settings_not_in_the_file():
    plan = read_galvatron_strategy(PIPELINE, world_size=8, mixed_precision="fp16", megatron_sp=True)
    assert plan.mixed_precision is Precision.FP16 and plan.megatron_sp


def test_output_file_name():
    plan = read_galvatron_strategy(PIPELINE, world_size=8)
    name = strategy_file_name(plan, "gpt-2.7b", num_nodes=1, memory_gb=40)
    assert name == "galvatron_config_gpt-2.7b_1nodes_8gpus_per_node_40GB_bf16.json"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"tp_sizes_enc": "2,16,1"}, "cfg.json: tp_sizes_enc[1]: 16 is larger than the 8 ranks of a pipeline stage"),
        (
            {"global_bsz": 4},
            "cfg.json: tp_sizes_enc[2]: a micro-batch of 4 samples cannot be split over data-parallel "
            "degree 8 (global_bsz / chunks must be a multiple of it)",
        ),
        # the reference splits uneven micro-batches like torch.chunk; Galva's Strategy needs equal ones
        ({"chunks": 3}, "cfg.json: global_bsz: 8 is not divisible by chunks 3"),
        ({"vtp": 16}, "cfg.json: vtp: 16 is larger than the 8 ranks of a pipeline stage"),
        ({"pp_deg": 3}, "cfg.json: pp_deg: 3 does not divide world_size 8"),
        ({"tp_sizes_enc": "2,x,1"}, "cfg.json: tp_sizes_enc[1]: expected an integer, got 'x'"),
        ({"dp_types_enc": None}, "cfg.json: dp_types_enc: missing"),
        ({"vcp": 3}, "cfg.json: vcp: 3 does not divide the 8 ranks of a pipeline stage"),
        (
            {"cp_sizes_enc": "2,8,1"},
            "cfg.json: cp_sizes_enc[1]: tp 2 x cp 8 is more than the 8 ranks of a pipeline stage",
        ),
        ({"tp_degree": 2}, "cfg.json: tp_degree: unknown key"),
    ],
)
def test_problems_are_reported_in_reference_names(changes, expected):
    data = {"pp_deg": 1, "tp_sizes_enc": "2,2,1", "dp_types_enc": "0,0,0", "global_bsz": 8}
    data = {key: value for key, value in {**data, **changes}.items() if value is not None}
    with pytest.raises(SchemaError) as info:
        read_galvatron_strategy(data, world_size=8, source="cfg.json")
    assert str(info.value) == expected


def test_context_parallel_degrees_convert_both_ways():
    data = {"pp_deg": 1, "tp_sizes_enc": "2,1,1", "dp_types_enc": "0,0,0", "global_bsz": 8, "cp_sizes_enc": "2,4,1",
            "vcp": 2}  # fmt: skip
    plan = read_galvatron_strategy(data, world_size=8, source="cfg.json")
    assert [layer.cp for layer in plan.layers] == [2, 4, 1] and plan.vocab.cp == 2
    assert [plan.layer_dp(i) for i in range(3)] == [2, 2, 8] and plan.vocab_dp == 4
    written = to_galvatron_strategy(plan)
    assert written["cp_sizes_enc"] == "2,4,1" and written["vcp"] == 2
    assert read_galvatron_strategy(written, world_size=8) == plan
