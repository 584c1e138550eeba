"""Every malformed file gives ONE line naming the file, the field (or reference key) and the layer."""

from __future__ import annotations

from pathlib import Path

import pytest

from galva_schema import HardwareProfile, ModelProfile, SchemaError, Strategy
from galva_schema.cli import validate_file
from galva_schema.reference import read_galvatron_hardware, read_galvatron_model_profile, read_galvatron_strategy

DATA = Path(__file__).parent / "data"
BAD = DATA / "malformed"
GOOD_HW = DATA / "galvatron" / "hardware"
MODELS = DATA / "galvatron" / "models"


def _hardware(replace: str):
    def load(path: Path):
        paths = {
            "allreduce_path": GOOD_HW / "allreduce_bandwidth_1nodes_8gpus_per_node.json",
            "p2p_path": GOOD_HW / "p2p_bandwidth_1nodes_8gpus_per_node.json",
            "sp_time_path": GOOD_HW / "sp_time_1nodes_8gpus_per_node.json",
            "overlap_path": GOOD_HW / "overlap_coefficient.json",
        }
        return read_galvatron_hardware(num_nodes=1, gpus_per_node=8, **{**paths, replace: path})

    return load


def _model(which: str):
    def load(path: Path):
        comp = MODELS / "computation_profiling_bf16_llama-7b_seqlen2048.json"
        mem = MODELS / "memory_profiling_bf16_llama-7b_seqlen2048.json"
        comp, mem = (path, mem) if which == "computation" else (comp, path)
        return read_galvatron_model_profile(comp, mem, model_name="m", num_layers=[32], hidden_sizes=[4096])

    return load


def _reference_strategy(path: Path):
    return read_galvatron_strategy(path, world_size=8)


CASES = [
    # Galva strategies
    ("strategy_tp_too_large.json", Strategy.load, "layers[3].tp: 8 is larger than the 4 ranks of a pipeline stage"),
    ("strategy_unknown_layer_key.json", Strategy.load, "layers[1].tp_consecutve: unknown key"),
    ("strategy_bad_dp_type.json", Strategy.load, "layers[2..3].dp_type: Input should be 'ddp', 'zero2' or 'zero3'"),
    (
        "strategy_future_version.json",
        Strategy.load,
        "schema_version: this galva-schema reads version 1, the file has 2",
    ),
    (
        "strategy_tp_too_large.json",
        HardwareProfile.load,
        "kind: expected 'galva.hardware_profile', got 'galva.strategy'",
    ),
    # Galva hardware profiles
    (
        "hardware_duplicate_allreduce.json",
        HardwareProfile.load,
        "allreduce[2]: duplicate entry for group_size 4 consecutive=True",
    ),
    (
        "hardware_times_mismatch.json",
        HardwareProfile.load,
        "allreduce_time[0]: message_mib has 3 sizes but time_ms has 2 times (group_size 2)",
    ),
    # Galva model profiles
    (
        "model_profile_no_tp1.json",
        ModelProfile.load,
        "layer_types[1].activation_mib_per_sample: layer type 'head' needs an entry for tp 1",
    ),
    ("model_profile_bad_form.json", ModelProfile.load, "layer_types[0].forward_time: Input tag 'linear'"),
    # reference strategies
    ("galvatron_config_bad_use_sp.json", _reference_strategy, "use_sp[3,5..6]: expected 0 or 1, got 2"),
    (
        "galvatron_config_short_checkpoint.json",
        _reference_strategy,
        "checkpoint: has 7 entries but tp_sizes_enc has 8 layers",
    ),
    (
        "galvatron_config_context_parallel.json",
        _reference_strategy,
        "cp_sizes_enc[0..1]: 3 does not divide the 8 ranks of a pipeline stage",
    ),
    (
        "galvatron_config_tp_too_large.json",
        _reference_strategy,
        "tp_sizes_enc[5]: 16 is larger than the 8 ranks of a pipeline stage",
    ),
    (
        "galvatron_config_bad_pipeline_type.json",
        _reference_strategy,
        "pipeline_type: expected one of gpipe, pipedream_flush, got '1f1b'",
    ),
    (
        "galvatron_config_bad_division.json",
        _reference_strategy,
        "pp_division: sums to 7 layers but the strategy has 8 layers",
    ),
    # reference hardware
    (
        "hardware_missing_allreduce/allreduce_bandwidth_1nodes_8gpus_per_node.json",
        _hardware("allreduce_path"),
        "allreduce_bandwidth_1nodes_8gpus_per_node.json: allreduce_size_4_consec_0: missing",
    ),
    (
        "hardware_bad_sp_time/sp_time_1nodes_8gpus_per_node.json",
        _hardware("sp_time_path"),
        "sp_time_1nodes_8gpus_per_node.json: all2all_size_4_64MB_time: expected a number of ms, got 'fast'",
    ),
    (
        "hardware_bad_p2p/p2p_bandwidth_1nodes_8gpus_per_node.json",
        _hardware("p2p_path"),
        "p2p_bandwidth_1nodes_8gpus_per_node.json: pp_size_3: pp 3 must be >= 2 and divide the world size 8",
    ),
    # reference model profiles
    (
        "memory_profiling_bf16_no_checkpoint.json",
        _model("memory"),
        "memory_profiling_bf16_no_checkpoint.json: layertype_0.2048.tp_activation_per_bsz_dict.checkpoint: missing",
    ),
    (
        "computation_profiling_bf16_negative.json",
        _model("computation"),
        "computation_profiling_bf16_negative.json: layertype_0_bsz8_seq2048: expected a non-negative number of ms per "
        "sample, got -1.0",
    ),
]


def test_every_malformed_file_is_used():
    used = {name for name, _, _ in CASES}
    on_disk = {str(p.relative_to(BAD)) for p in BAD.rglob("*.json")}
    assert on_disk == used
    assert len(on_disk) >= 12


@pytest.mark.parametrize(("name", "load", "expected"), CASES, ids=[f"{c[0]}-{c[1].__name__}" for c in CASES])
def test_one_line_error_naming_file_and_field(name, load, expected):
    path = BAD / name
    with pytest.raises(SchemaError) as info:
        load(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path) + ": "), message  # the file comes first
    assert expected in message, message


@pytest.mark.parametrize(
    "name",
    [c[0] for c in CASES if c[1] in (Strategy.load, HardwareProfile.load, ModelProfile.load) and "version" not in c[0]],
)
def test_galva_files_fail_the_same_way_through_kind_detection(name):
    with pytest.raises(SchemaError) as info:
        validate_file(BAD / name)
    assert str(info.value).startswith(str(BAD / name) + ": ") and "\n" not in str(info.value)
