"""write_json_atomic and GalvaFile.save: no temporary file left behind, never a half-written file."""

from __future__ import annotations

import json
import os
import stat

import pytest

from galva_schema import Strategy, write_json_atomic
from galva_schema.reference import write_galvatron_strategy


def test_writes_and_leaves_only_the_target(tmp_path):
    path = write_json_atomic(tmp_path / "sub" / "out.json", {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert path.read_text().endswith("\n")
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.json"]


def test_file_mode_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    os.umask(old)
    path = write_json_atomic(tmp_path / "out.json", {})
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~old  # not mkstemp's 0600


@pytest.mark.parametrize(
    "bad", [{"x": object()}, {"x": float("nan")}, {"x": [1, {2, 3}]}], ids=["object", "nan", "set"]
)
def test_error_midway_keeps_the_old_file_and_removes_the_temporary(tmp_path, bad):
    path = tmp_path / "out.json"
    path.write_text('{"old": true}\n')
    with pytest.raises((TypeError, ValueError)):
        write_json_atomic(path, {"first": list(range(1000)), **bad})
    assert path.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_error_on_a_new_file_leaves_nothing(tmp_path):
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "new.json", {"x": object()})
    assert list(tmp_path.iterdir()) == []


def test_save_and_reference_writers_leave_no_temporary_files(tmp_path):
    plan = Strategy.uniform(world_size=2, num_layers=2, global_batch_size=4)
    plan.save(tmp_path / "plan.json")
    write_galvatron_strategy(plan, tmp_path / "galvatron_config.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["galvatron_config.json", "plan.json"]


def test_a_full_disk_raises_enospc_keeps_the_old_file_and_leaves_no_temporary(small_disk):
    """Issue #22, at the writer every command shares: a real 64 KiB tmpfs, filled after the first write."""
    import errno

    disk = small_disk("64k")
    path = write_json_atomic(disk / "out.json", {"old": True})
    before = path.read_bytes()
    with open(disk / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):
        while True:  # until the disk is full
            filler.write(b"\0" * 4096)
    with pytest.raises(OSError) as err:
        write_json_atomic(path, {"new": "x" * 10_000})
    assert err.value.errno == errno.ENOSPC
    assert path.read_bytes() == before
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "out.json"]
