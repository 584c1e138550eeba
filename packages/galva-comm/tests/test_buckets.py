"""The bucket rule galva-hp reduces ddp gradients by and galva-search prices them by."""

from __future__ import annotations

import pytest

from galva_comm.buckets import BUCKET_CAP_BYTES, gradient_buckets

MIB = 2**20


def test_small_units_of_one_key_share_a_bucket_up_to_the_cap() -> None:
    # backward order: head, 4 layers, embedding, all of one chunk and group
    assert gradient_buckets(["g"] * 6, [0.1 * MIB] * 6, BUCKET_CAP_BYTES) == [[0, 1, 2, 3, 4, 5]]
    # the cap is cumulative: 10 MiB units fill 25 MiB with two, then start over
    assert gradient_buckets(["g"] * 5, [10 * MIB] * 5, BUCKET_CAP_BYTES) == [[0, 1], [2, 3], [4]]
    # a unit at the cap exactly still fits an empty bucket; one over it stands alone
    assert gradient_buckets(["g"] * 3, [25 * MIB, 1, 30 * MIB], BUCKET_CAP_BYTES) == [[0], [1], [2]]


def test_a_new_key_starts_a_new_bucket_and_cap_zero_keeps_one_per_unit() -> None:
    keys = [(1, "dp"), (0, "dp"), (0, "dp"), (0, "tp-dp"), (0, "dp")]  # (chunk, group)
    assert gradient_buckets(keys, [1.0] * 5, BUCKET_CAP_BYTES) == [[0], [1, 2], [3], [4]]
    assert gradient_buckets(["g"] * 3, [1.0] * 3, 0) == [[0], [1], [2]]
    assert gradient_buckets([], [], BUCKET_CAP_BYTES) == []


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="2 keys but 1 sizes"):
        gradient_buckets(["a", "b"], [1.0], BUCKET_CAP_BYTES)
