"""The sequence axis of a layer's arguments is found from two recordings, and only per-position ones are cut."""

from __future__ import annotations

import torch

from galva_models.tables.positions import cut_to_positions, sequence_axes


def _call(seq: int, batch: int = 2) -> dict[str, object]:
    return {
        "position_embeddings": (torch.randn(batch, seq, 8), torch.randn(batch, seq, 8)),
        "attention_scaling": torch.randn(batch, 1, seq, 1),  # Beam's per-position query scale
        "position_ids": torch.arange(seq).expand(batch, seq),
        "cache_position": torch.arange(seq),
        "attention_mask": torch.ones(batch, 1, 1, seq),  # a key mask: read against the whole sequence
        "bias": torch.randn(batch, 4, seq, seq),  # pairs of positions
        "scale": torch.randn(batch, seq),  # batch == seq below: the axis is found by length, not by size
        "flag": True,
    }


def test_per_position_arguments_are_cut_along_the_axis_that_follows_the_length():
    whole, shorter = _call(2), _call(1)
    axes = sequence_axes(whole, shorter)
    assert axes["position_embeddings"] == (1, 1)
    assert axes["attention_scaling"] == 2
    assert axes["scale"] == 1 and axes["cache_position"] == 0
    assert axes["attention_mask"] is None and axes["bias"] is None and axes["flag"] is None
    positions = torch.tensor([1])
    cut = cut_to_positions(whole, axes, positions)
    assert torch.equal(cut["attention_scaling"], whole["attention_scaling"][:, :, 1:])
    assert torch.equal(cut["position_embeddings"][1], whole["position_embeddings"][1][:, 1:])
    assert torch.equal(cut["cache_position"], torch.tensor([1]))
    assert cut["attention_mask"] is whole["attention_mask"] and cut["bias"] is whole["bias"]
    assert cut["flag"] is True
