"""Sharded Hugging Face checkpoints in and out; the progress bar."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open


def test_sharded_in_sharded_out(tmp_path: Path, cli, tiny) -> None:
    model = tiny.save(tmp_path / "hf", "tiny-qwen2", max_shard_size="40KB")
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    assert cli("g2h", tmp_path / "galva", tmp_path / "back", "--max-shard-size", "50KB").code == 0

    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == sorted(p.name for p in (tmp_path / "back").glob("model-*.safetensors"))
    assert not (tmp_path / "back" / "model.safetensors").exists()
    total = 0
    for shard in shards:
        path = tmp_path / "back" / shard
        with safe_open(str(path), "pt") as handle:
            names = list(handle.keys())
            assert {index["weight_map"][n] for n in names} == {shard}
            sizes = [handle.get_tensor(n).nbytes for n in names]
        total += sum(sizes)
        assert sum(sizes) <= 50_000 or len(names) == 1  # a bigger tensor gets a shard of its own
    assert index["metadata"]["total_size"] == total
    back = type(model).from_pretrained(tmp_path / "back", local_files_only=True)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_single_file_out_when_it_fits(tmp_path: Path, cli, tiny) -> None:
    tiny.save(tmp_path / "hf", "tiny-t5", max_shard_size="20KB")
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    assert cli("g2h", tmp_path / "galva", tmp_path / "back").code == 0
    assert (tmp_path / "back" / "model.safetensors").is_file()
    assert not (tmp_path / "back" / "model.safetensors.index.json").exists()


def test_progress_on_stderr(tmp_path: Path, cli, tiny) -> None:
    """stderr here is not a terminal: plain lines (the last says all bytes are done), no bar frames."""
    tiny.save(tmp_path / "hf", "tiny-gpt2")
    for command, source, out in (("h2g", "hf", "galva"), ("g2h", "galva", "back")):
        run = cli(command, tmp_path / source, tmp_path / out, progress=True)
        assert run.code == 0 and "\r" not in run.err
        done, total = re.match(rf"{command}: ([\d.]+)/([\d.]+) MiB, ", run.err.splitlines()[-1]).groups()
        assert done == total and float(total) > 0
    assert cli("g2h", tmp_path / "galva", tmp_path / "quiet").err == ""  # --no-progress
