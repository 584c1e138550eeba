"""Checkpoints are read as safetensors and JSON only: a pickle next to the weights is never executed."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path


class _Payload:
    """Unpickling this runs ``open(marker, 'w')``: proof that something unpickled the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (str(self.marker), "w"))


def _plant(directory: Path, marker: Path) -> None:
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    (directory / "training_args.pt").write_bytes(pickle.dumps(_Payload(marker)))


def test_payload_really_runs_when_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Payload(marker)))  # the check below is meaningful: unpickling creates the marker
    assert marker.exists()


def test_pickles_are_neither_read_nor_copied(tmp_path: Path, cli, tiny) -> None:
    marker = tmp_path / "ran"
    tiny.save(tmp_path / "hf", "tiny-llama")
    _plant(tmp_path / "hf", marker)
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    assert cli("info", tmp_path / "galva").code == 0
    assert cli("g2h", tmp_path / "galva", tmp_path / "back").code == 0
    assert not marker.exists()
    names = [p.name for p in (tmp_path / "galva").rglob("*") if p.is_file()]
    assert all(n.endswith(".safetensors") or n.endswith(".json") for n in names), names
    assert json.loads((tmp_path / "galva" / "manifest.json").read_text())["hf_files"] == ["generation_config.json"]


def test_pickle_only_checkpoint_is_refused(tmp_path: Path, cli, tiny) -> None:
    marker = tmp_path / "ran"
    tiny.save(tmp_path / "hf", "tiny-llama")
    os.remove(tmp_path / "hf" / "model.safetensors")
    _plant(tmp_path / "hf", marker)
    run = cli("h2g", tmp_path / "hf", tmp_path / "galva")
    assert run.code == 2 and "only safetensors weights are read" in run.err
    assert not marker.exists()
