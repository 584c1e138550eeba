"""Reference (Galvatron) model profiles: static / batch / sequence forms, memory formats, round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from galva_schema import BatchTime, ModelProfile, Precision, SchemaError, SequenceTime, StaticTime
from galva_schema.reference import (
    galvatron_model_profile_file_names,
    read_galvatron_model_profile,
    to_galvatron_model_profile,
    write_galvatron_model_profile,
)

MODELS = Path(__file__).parent / "data" / "galvatron" / "models"
LLAMA = {"model_name": "llama-7b", "num_layers": [32], "hidden_sizes": [4096]}
T5 = {"model_name": "t5-3B", "num_layers": [24, 24], "hidden_sizes": [1024, 1024], "time_mode": "batch"}
ACT_2048 = {1: 301.2817, 2: 182.1565, 4: 123.0939, 8: 93.5626}  # spec §4.6 (the shipped llama_hf file)


def _read(comp: str, mem: str, **kwargs) -> ModelProfile:
    return read_galvatron_model_profile(MODELS / comp, MODELS / mem, **{**LLAMA, **kwargs})


def _static() -> ModelProfile:
    return _read(
        "computation_profiling_bf16_llama-7b_seqlen2048.json", "memory_profiling_bf16_llama-7b_seqlen2048.json"
    )


def _json(name: str) -> dict:
    return json.loads((MODELS / name).read_text())


def test_static_profile_maps_every_field():
    profile = _static()
    assert profile.precision is Precision.BF16 and not profile.megatron_sp
    layer = profile.layer_types[0]
    assert (layer.name, layer.num_layers, layer.hidden_size, layer.seq_length) == ("layertype_0", 32, 4096, 2048)
    assert layer.forward_time == StaticTime(ms_per_sample=4.789421272277832, batch_size=8)
    assert layer.forward_time.forward_ms(8, 2048) == pytest.approx(8 * 4.789421272277832)
    assert layer.parameter_mib == 773.2509765625
    assert layer.activation_mib_per_sample == ACT_2048
    assert layer.checkpoint_activation_mib_per_sample == 16.0
    vocab = profile.vocab
    assert vocab.forward_time == StaticTime(ms_per_sample=3.8, batch_size=8)
    assert vocab.memory_pp_off.model_states_mib == {1: 4258.0, 2: 2200.0, 4: 1150.0, 8: 600.0}
    assert vocab.memory_pp_off.activation_mib_per_sample == {1: 572.5, 2: 300.0, 4: 160.0, 8: 90.0}
    assert vocab.memory_pp_first.activation_mib_per_sample == {1: 46.56, 2: 25.0, 4: 14.0}
    assert vocab.memory_pp_last.activation_mib_per_sample == {1: 500.0, 2: 260.0, 4: 140.0}


def test_old_flat_format():
    profile = _read(
        "computation_profiling_bf16_hidden4096_head32_seqlen2048.json",
        "memory_profiling_bf16_hidden4096_head32_seqlen2048.json",
    )
    layer = profile.layer_types[0]
    assert layer.seq_length == 2048  # only the file name says it
    assert layer.forward_time == StaticTime(ms_per_sample=4.789421272277832)
    assert layer.activation_mib_per_sample == ACT_2048
    assert profile.vocab.forward_time.ms_per_sample == 3.8
    assert profile.vocab.memory_pp_off.model_states_mib == {1: 4258.0}  # scalar = vocabulary tp 1
    assert profile.vocab.memory_pp_first.activation_mib_per_sample == {1: 46.56}
    assert profile.vocab.memory_pp_last.activation_mib_per_sample == {1: 500.0}


def test_batch_mode_fits_time_of_the_whole_batch():
    profile = _read(
        "computation_profiling_bf16_llama-7b_all.json",
        "memory_profiling_bf16_llama-7b_seqlen2048.json",
        time_mode="batch",
    )
    layer_time = profile.layer_types[0].forward_time
    assert isinstance(layer_time, BatchTime)
    assert (layer_time.slope_ms_per_sample, layer_time.intercept_ms) == pytest.approx((4.75, 0.3125), rel=1e-9)
    other = profile.vocab.forward_time
    assert (other.slope_ms_per_sample, other.intercept_ms) == pytest.approx((2.5, 10.0), rel=1e-9)
    assert other.forward_ms(4, 2048) == pytest.approx(20.0)


def test_static_mode_on_a_batch_file_takes_the_largest_or_the_requested_batch():
    args = ("computation_profiling_bf16_llama-7b_all.json", "memory_profiling_bf16_llama-7b_seqlen2048.json")
    assert _read(*args).layer_types[0].forward_time == StaticTime(ms_per_sample=4.75 + 0.3125 / 8, batch_size=8)
    picked = _read(*args, static_batch_size=2).layer_types[0].forward_time
    assert picked == StaticTime(ms_per_sample=4.75 + 0.3125 / 2, batch_size=2)


def test_sequence_modes_fit_and_scale():
    profile = _read(
        "computation_profiling_bf16_llama-7b.json",
        "memory_profiling_bf16_llama-7b.json",
        time_mode="sequence",
        memory_mode="sequence",
        seq_lengths=[2048],
    )
    assert profile.megatron_sp  # only _sp sections in the file
    layer = profile.layer_types[0]
    assert isinstance(layer.forward_time, SequenceTime)
    assert layer.forward_time.coefficients == pytest.approx((1e-7, 2e-3, 0.1), rel=1e-6)
    assert profile.vocab.forward_time.coefficients == pytest.approx((0.0, 1.8e-3, 0.1), rel=1e-6, abs=1e-12)
    # parameters from the smallest profiled length, activations from the largest scaled by 2048 / 8192
    assert layer.parameter_mib == 773.2509765625
    assert layer.activation_mib_per_sample == pytest.approx(ACT_2048)
    assert layer.checkpoint_activation_mib_per_sample == pytest.approx(16.0)
    assert profile.vocab.memory_pp_off.model_states_mib == {1: 4258.0, 2: 2200.0, 4: 1150.0, 8: 600.0}
    assert profile.vocab.memory_pp_last.activation_mib_per_sample == pytest.approx({1: 500.0, 2: 260.0, 4: 140.0})


def test_two_layer_types():
    profile = read_galvatron_model_profile(
        MODELS / "computation_profiling_bf16_t5-3B.json",
        MODELS / "memory_profiling_bf16_t5-3B.json",
        **T5,
        layer_type_names=["encoder", "decoder"],
    )
    assert profile.num_layers == 48 and profile.sequence_lengths == (512, 512) and profile.megatron_sp
    assert [t.name for t in profile.layer_types] == ["encoder", "decoder"]
    assert profile.layer_type_of(23) == 0 and profile.layer_type_of(24) == 1
    assert profile.layer_types[1].parameter_mib == 128.0
    assert profile.layer_types[1].activation_mib_per_sample[8] == 8.375
    assert profile.layer_types[1].forward_time.slope_ms_per_sample == pytest.approx(1.75)
    assert profile.vocab.forward_time.intercept_ms == pytest.approx(2.0)
    assert profile.vocab.memory_pp_first.model_states_mib == {1: 1000.0, 2: 500.0, 4: 250.0}


def test_reference_to_galva_to_reference_static():
    comp, mem = to_galvatron_model_profile(_static())
    original_comp = _json("computation_profiling_bf16_llama-7b_seqlen2048.json")
    assert comp == {k: v for k, v in original_comp.items() if not k.startswith("layernum")}
    assert mem == _json("memory_profiling_bf16_llama-7b_seqlen2048.json")


def test_reference_to_galva_to_reference_batch_two_types():
    profile = read_galvatron_model_profile(
        MODELS / "computation_profiling_bf16_t5-3B.json", MODELS / "memory_profiling_bf16_t5-3B.json", **T5
    )
    comp, mem = to_galvatron_model_profile(profile, batch_sizes=range(1, 9))
    original = _json("computation_profiling_bf16_t5-3B.json")
    assert comp.keys() == original.keys()
    assert comp == pytest.approx(original, rel=1e-12)
    assert mem == _json("memory_profiling_bf16_t5-3B.json")


def test_reference_to_galva_to_reference_sequence():
    profile = _read(
        "computation_profiling_bf16_llama-7b.json",
        "memory_profiling_bf16_llama-7b.json",
        time_mode="sequence",
        memory_mode="sequence",
        seq_lengths=[2048],
    )
    comp, _ = to_galvatron_model_profile(profile, sequence_lengths=[1024, 2048, 3072, 4096, 6144, 8192])
    original = _json("computation_profiling_bf16_llama-7b.json")
    assert comp.keys() == original.keys()
    assert comp == pytest.approx(original, rel=1e-9)


@pytest.mark.parametrize(
    ("comp", "mem", "kwargs"),
    [
        ("computation_profiling_bf16_llama-7b_seqlen2048.json", "memory_profiling_bf16_llama-7b_seqlen2048.json", {}),
        (
            "computation_profiling_bf16_llama-7b_all.json",
            "memory_profiling_bf16_llama-7b_seqlen2048.json",
            {"time_mode": "batch"},
        ),
        (
            "computation_profiling_bf16_llama-7b.json",
            "memory_profiling_bf16_llama-7b.json",
            {"time_mode": "sequence", "memory_mode": "sequence", "seq_lengths": [2048]},
        ),
    ],
    ids=["static", "batch", "sequence"],
)
def test_galva_to_reference_to_galva(comp, mem, kwargs, tmp_path):
    profile = _read(comp, mem, **kwargs)
    assert ModelProfile.load(profile.save(tmp_path / "profile.json")) == profile
    comp_out, mem_out = write_galvatron_model_profile(
        profile, tmp_path / "computation_profiling_bf16_x.json", tmp_path / "memory_profiling_bf16_x.json"
    )
    mode = kwargs.get("time_mode", "static")
    again = read_galvatron_model_profile(comp_out, mem_out, **LLAMA, time_mode=mode, seq_lengths=[2048])
    assert again.megatron_sp == profile.megatron_sp
    assert again.layer_types[0].model_dump(exclude={"forward_time"}) == profile.layer_types[0].model_dump(
        exclude={"forward_time"}
    )
    assert again.vocab.model_dump(exclude={"forward_time"}) == profile.vocab.model_dump(exclude={"forward_time"})
    for new, old in (
        (again.layer_types[0].forward_time, profile.layer_types[0].forward_time),
        (again.vocab.forward_time, profile.vocab.forward_time),
    ):
        assert type(new) is type(old)
        new_numbers, old_numbers = _numbers(new.model_dump()), _numbers(old.model_dump())
        assert new_numbers == pytest.approx(old_numbers, rel=1e-9, abs=1e-15)


def _numbers(dumped: dict) -> list:
    out = []
    for value in dumped.values():
        if isinstance(value, (tuple, list)):
            out.extend(value)
        elif not isinstance(value, str):
            out.append(value)
    return out


def test_file_names_and_precision_inference(tmp_path):
    assert galvatron_model_profile_file_names("llama-7b", "fp16") == (
        "computation_profiling_fp16_llama-7b.json",
        "memory_profiling_fp16_llama-7b.json",
    )
    comp, mem = tmp_path / "comp.json", tmp_path / "mem.json"
    comp.write_text((MODELS / "computation_profiling_bf16_llama-7b_seqlen2048.json").read_text())
    mem.write_text((MODELS / "memory_profiling_bf16_llama-7b_seqlen2048.json").read_text())
    with pytest.raises(SchemaError, match="precision: neither file name"):
        read_galvatron_model_profile(comp, mem, **LLAMA)
    assert read_galvatron_model_profile(comp, mem, **LLAMA, precision="fp32").precision is Precision.FP32


def test_megatron_sp_choice(tmp_path):
    both = {
        **_json("memory_profiling_bf16_llama-7b_seqlen2048.json"),
        **{k + "_sp": v for k, v in _json("memory_profiling_bf16_llama-7b_seqlen2048.json").items()},
    }
    mem = tmp_path / "memory_profiling_bf16_both.json"
    mem.write_text(json.dumps(both))
    comp = MODELS / "computation_profiling_bf16_llama-7b_seqlen2048.json"
    plain = read_galvatron_model_profile(comp, mem, **LLAMA)  # both kinds: the plain ones, as the reference's default
    assert not plain.megatron_sp and plain == read_galvatron_model_profile(comp, mem, **LLAMA, megatron_sp=False)
    assert read_galvatron_model_profile(comp, mem, **LLAMA, megatron_sp=True).megatron_sp
    with pytest.raises(
        SchemaError, match=r"layertype_0: missing \(the file has layertype_0_sp: pass megatron_sp=True\)"
    ):
        read_galvatron_model_profile(
            comp, MODELS / "memory_profiling_bf16_llama-7b.json", **LLAMA, seq_lengths=[2048], megatron_sp=False
        )


def test_several_sequence_lengths_need_a_target():
    with pytest.raises(SchemaError, match=r"seq_lengths: layertype_0 is profiled at 6 sequence lengths"):
        _read(
            "computation_profiling_bf16_llama-7b.json",
            "memory_profiling_bf16_llama-7b.json",
            time_mode="sequence",
            memory_mode="sequence",
        )
    with pytest.raises(SchemaError, match=r"layertype_0_sp: no entry for sequence length 3072 \(profiled: 1024, 2048"):
        _read(
            "computation_profiling_bf16_llama-7b.json",
            "memory_profiling_bf16_llama-7b.json",
            time_mode="sequence",
            seq_lengths=[3072],
        )


def test_argument_problems():
    with pytest.raises(SchemaError, match="hidden_sizes: has 1 entries but num_layers has 2 layer types"):
        read_galvatron_model_profile(
            MODELS / "computation_profiling_bf16_t5-3B.json",
            MODELS / "memory_profiling_bf16_t5-3B.json",
            **{**T5, "hidden_sizes": [1024]},
        )
    with pytest.raises(SchemaError, match="sequence profile modes support a model with one layer type"):
        read_galvatron_model_profile(
            MODELS / "computation_profiling_bf16_t5-3B.json",
            MODELS / "memory_profiling_bf16_t5-3B.json",
            **{**T5, "time_mode": "sequence"},
        )
