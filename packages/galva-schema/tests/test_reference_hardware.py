"""Reference (Galvatron) hardware files: reading, writing, round trips."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from galva_schema import HardwareProfile, SchemaError
from galva_schema.reference import (
    galvatron_hardware_file_names,
    read_galvatron_hardware,
    to_galvatron_hardware,
    write_galvatron_hardware,
)

HARDWARE = Path(__file__).parent / "data" / "galvatron" / "hardware"
NAMES = galvatron_hardware_file_names(1, 8)


def _read(directory: Path = HARDWARE) -> HardwareProfile:
    return read_galvatron_hardware(directory, num_nodes=1, gpus_per_node=8)


def test_reads_the_shipped_layout():
    profile = _read()
    assert profile.cluster.world_size == 8 and profile.backend == "nccl"
    assert profile.allreduce_bandwidth(8) == 154.203
    assert profile.allreduce_bandwidth(8, consecutive=False) == 154.203  # the world group has one layout
    assert profile.allreduce_bandwidth(4, consecutive=False) == 155.815
    assert profile.allreduce_bandwidth(2, consecutive=True) == 138.156
    # spec §4.6: coe = 1 / bandwidth
    assert 1 / profile.allreduce_bandwidth(4, consecutive=True) == pytest.approx(0.0062846, rel=1e-4)
    assert [(e.pp, e.bandwidth_gb_per_s) for e in profile.p2p] == [(2, 163.67), (4, 138.58), (8, 109.45)]
    assert profile.overlap_slowdown == 1.1255526
    assert [t.group_size for t in profile.allreduce_time] == [8, 4, 2]
    assert all(len(t.message_mib) == 11 and t.message_mib[-1] == 1024 for t in profile.all_to_all_time)


def test_sp_times_are_stored_raw_and_the_spec_fit_follows_by_halving():
    profile = _read()
    allreduce8 = next(t for t in profile.allreduce_time if t.group_size == 8)
    assert allreduce8.time_ms[-1] == 8.38012054  # raw, exactly as in the file
    slope, intercept = allreduce8.linear_fit()
    # spec §4.6: the reference halves all-reduce times, then fits [m, c] = [0.00400654, 0.08736331]
    assert (slope / 2, intercept / 2) == pytest.approx((0.00400654, 0.08736331), rel=1e-6)
    all2all8 = next(t for t in profile.all_to_all_time if t.group_size == 8)
    assert all2all8.linear_fit() == pytest.approx((0.00460486, 0.11025102), rel=1e-6)


def test_reference_to_galva_to_reference_is_identical(tmp_path):
    written = write_galvatron_hardware(_read(), tmp_path)
    assert sorted(p.name for p in written) == sorted(NAMES.values())
    for name in NAMES.values():
        assert json.loads((tmp_path / name).read_text()) == json.loads((HARDWARE / name).read_text()), name


def test_galva_to_reference_to_galva_is_identity(tmp_path):
    profile = _read()
    assert HardwareProfile.load(profile.save(tmp_path / "hw.json")) == profile
    write_galvatron_hardware(profile, tmp_path / "ref")
    assert _read(tmp_path / "ref") == profile


def test_explicit_paths_and_optional_sp_time(tmp_path):
    profile = read_galvatron_hardware(
        num_nodes=1,
        gpus_per_node=8,
        allreduce_path=HARDWARE / NAMES["allreduce"],
        p2p_path=HARDWARE / NAMES["p2p"],
        overlap_path=HARDWARE / NAMES["overlap"],
    )
    assert profile.allreduce_time == () and profile.all_to_all_time == ()
    assert "sp_time_1nodes_8gpus_per_node.json" not in to_galvatron_hardware(profile)
    # the same through a directory without the sp_time file
    for key in ("allreduce", "p2p", "overlap"):
        shutil.copy(HARDWARE / NAMES[key], tmp_path / NAMES[key])
    assert _read(tmp_path) == profile


def test_overlap_is_clamped_to_one(tmp_path):
    shutil.copytree(HARDWARE, tmp_path / "hw")
    (tmp_path / "hw" / "overlap_coefficient.json").write_text('{"overlap_coe": 0.97}')
    assert _read(tmp_path / "hw").overlap_slowdown == 1.0


def test_two_nodes_need_every_group_size(tmp_path):
    bandwidths = {"allreduce_size_16_consec_1": 44.7}
    for n in (8, 4, 2):
        bandwidths |= {f"allreduce_size_{n}_consec_1": 150.0, f"allreduce_size_{n}_consec_0": 20.0}
    names = galvatron_hardware_file_names(2, 8)
    (tmp_path / names["allreduce"]).write_text(json.dumps(bandwidths))
    (tmp_path / names["p2p"]).write_text(json.dumps({f"pp_size_{p}": 8.0 for p in (2, 4, 8, 16)}))
    (tmp_path / names["overlap"]).write_text('{"overlap_coe": 1.2}')
    profile = read_galvatron_hardware(tmp_path, num_nodes=2, gpus_per_node=8)
    assert profile.cluster.world_size == 16 and profile.allreduce_bandwidth(8, consecutive=False) == 20.0
    del bandwidths["allreduce_size_2_consec_0"]
    (tmp_path / names["allreduce"]).write_text(json.dumps(bandwidths))
    with pytest.raises(SchemaError) as info:
        read_galvatron_hardware(tmp_path, num_nodes=2, gpus_per_node=8)
    assert str(info.value).endswith(
        "allreduce_bandwidth_2nodes_8gpus_per_node.json: allreduce_size_2_consec_0: missing"
    )


def test_missing_directory_file_is_named(tmp_path):
    with pytest.raises(SchemaError, match=r"p2p_bandwidth_1nodes_8gpus_per_node.json: file not found"):
        shutil.copy(HARDWARE / NAMES["allreduce"], tmp_path)
        _read(tmp_path)
