"""The API training will use: module files, optimizer state, RNG, scheduler and data position; slices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from galva_ckpt import CheckpointError, CheckpointReader, CheckpointWriter, atomic_directory
from galva_ckpt.info import describe


def _save(out: Path) -> dict[str, torch.Tensor]:
    weights = {
        "w": torch.arange(48, dtype=torch.float32).reshape(6, 8),
        "b": torch.arange(6, dtype=torch.bfloat16),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    with atomic_directory(out) as tmp:
        writer = CheckpointWriter(tmp)
        writer.write_module("embedding", {"e": torch.ones(4, 2)})
        writer.write_module("layers.0", weights)
        writer.write_module("head", {"h": torch.zeros(0, 3)})  # empty tensors are legal
        writer.write_optimizer_module("layers.0", {"exp_avg/w": weights["w"] * 0.1, "exp_avg_sq/w": weights["w"] ** 2})
        writer.write_rng({"rank0/cpu": torch.get_rng_state()})
        writer.finish(
            family="toy",
            config={"model_type": "toy"},
            num_layers=1,
            step=7,
            optimizer={"step": 7, "hyperparameters": {"lr": 1e-3, "beta1": 0.9}},
            scheduler={"kind": "cosine", "last_step": 7},
            data_position={"consumed_samples": 56},
        )
    return weights


def test_write_then_read_every_part(tmp_path: Path) -> None:
    weights = _save(tmp_path / "ckpt")
    reader = CheckpointReader(tmp_path / "ckpt")
    got = reader.read_module("layers.0")
    assert list(got) == list(weights) and all(torch.equal(got[k], weights[k]) for k in weights)
    assert all(got[k].dtype == weights[k].dtype for k in weights)
    # the files are plain safetensors, readable by the library itself
    plain = load_file(tmp_path / "ckpt" / "model" / "layers.0.safetensors")
    assert all(torch.equal(plain[k], weights[k]) for k in weights)
    optim = reader.read_module("layers.0", optimizer=True)
    assert torch.equal(optim["exp_avg_sq/w"], weights["w"] ** 2)
    assert torch.equal(reader.read_rng()["rank0/cpu"], torch.get_rng_state())
    m = reader.manifest
    assert (m.step, m.optimizer.step, m.scheduler, m.data_position) == (
        7,
        7,
        {"kind": "cosine", "last_step": 7},
        {"consumed_samples": 56},
    )
    assert reader.read_module("head")["h"].shape == (0, 3)
    text = describe(tmp_path / "ckpt")
    assert "adamw step 7" in text and "5 files OK" in text and "consumed_samples" in text


def test_read_slice_reads_part_of_a_tensor(tmp_path: Path) -> None:
    weights = _save(tmp_path / "ckpt")
    reader = CheckpointReader(tmp_path / "ckpt")
    assert torch.equal(reader.read_slice("layers.0", "w", (slice(2, 4),)), weights["w"][2:4])  # a dim-0 (row) shard
    assert torch.equal(reader.read_slice("layers.0", "w", (slice(None), slice(4, 8))), weights["w"][:, 4:8])
    with pytest.raises(CheckpointError, match="tensor nope is not in the manifest"):
        reader.read_slice("layers.0", "nope", (slice(None),))


def test_writer_refuses_a_tensor_that_differs_from_its_header(tmp_path: Path) -> None:
    from galva_schema.checkpoint import TensorInfo

    with pytest.raises(CheckpointError, match="tensor x is"), atomic_directory(tmp_path / "ckpt") as tmp:
        CheckpointWriter(tmp).stream_module("layers.0", {"x": TensorInfo(shape=(2,), dtype="float32")}, [torch.ones(3)])
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_module_of_resolves_tied_names(tmp_path: Path, cli, tiny) -> None:
    tiny.save(tmp_path / "hf", "tiny-t5")
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    reader = CheckpointReader(tmp_path / "galva")
    assert reader.module_of("lm_head.weight") == "embedding"
    assert reader.module_of("decoder.block.1.layer.2.DenseReluDense.wo.weight") == "layers.3"
