"""Which ddp units share one gradient all-reduce (a *bucket*): the one rule galva-hp's runtime forms its buckets by
(:class:`galva_hp.grad_buckets.BucketReducer`) and galva-search prices them by (docs/cost-model.md §3). Pure Python.

Units are taken in the order backward finishes them (the model's last unit first). A unit joins the bucket of the
unit before it when both have the same key (model chunk, reduction group and dtype: units the runtime arms apart or
reduces over other ranks never share a collective) and the bucket stays within the cap; otherwise it starts a new
bucket. torch DDP's default cap, 25 MiB, keeps one bucket per layer for layers of that size or more and puts a model
of small layers into one all-reduce (on gloo each collective costs about a CPU-millisecond per rank, whatever its
size).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["BUCKET_CAP_BYTES", "gradient_buckets"]

BUCKET_CAP_BYTES = 25 * 2**20
"""Units stop joining a bucket once it would hold more bytes of gradients (torch DDP's ``bucket_cap_mb``)."""


def gradient_buckets(keys: Sequence[Hashable], nbytes: Sequence[float], cap_bytes: float) -> list[list[int]]:
    """Buckets of the units ``0 .. n-1``, given in backward order with their ``keys`` and gradient ``nbytes`` (in the
    reduce dtype): lists of unit indices, each in backward order, the buckets in launch order. ``cap_bytes`` 0 (or
    less than every pair) gives one bucket per unit."""
    if len(keys) != len(nbytes):
        raise ValueError(f"gradient_buckets: {len(keys)} keys but {len(nbytes)} sizes")
    buckets: list[list[int]] = []
    filled = 0.0
    for i, (key, size) in enumerate(zip(keys, nbytes)):
        if buckets and keys[buckets[-1][-1]] == key and filled + size <= cap_bytes:
            buckets[-1].append(i)
            filled += size
        else:
            buckets.append([i])
            filled = size
    return buckets
