"""The two rules that say what part of the data a rank holds. Defined here once; every package asks these.

- **Batch share**: a batch is cut into equal *contiguous* blocks, micro-batch ``k`` of ``n`` is the ``k``-th block
  of the global batch, and data-parallel index ``d`` of ``dp`` holds the ``d``-th block of a micro-batch; a
  sequence-sharded rank holds the ``p``-th contiguous block of the sequence (:func:`contiguous_block`).
- **Sequence sharding**: a layer's boundary activations are split along the sequence over its model-parallel group
  when it runs Ulysses (or the vocabulary layers run sequence parallel), or when Megatron-SP is on and its tp
  degree is above 1; otherwise every rank of the group holds the whole sequence (:func:`sequence_shards`).
"""

from __future__ import annotations

__all__ = ["contiguous_block", "sequence_shards"]


def sequence_shards(degree: int, *, ulysses: bool, megatron_sp: bool) -> int:
    """Into how many slices a layer of model-parallel ``degree`` splits the sequence at its boundaries.

    ``ulysses`` is a layer's Ulysses flag (or the vocabulary layers' ``sp``); ``megatron_sp`` the strategy's flag.
    """
    return degree if ulysses or (megatron_sp and degree > 1) else 1


def contiguous_block(
    total: int,
    parts: int,
    index: int,
    *,
    what: str = "batch of",
    unit: str = "samples",
    parts_name: str | None = None,
) -> slice:
    """Block ``index`` of ``total`` items cut into ``parts`` equal contiguous blocks.

    Raises ``ValueError`` with one line when ``parts`` does not divide ``total`` (``a batch of 6 samples cannot be
    split into 4 equal parts``, or ``... cannot be split over data-parallel degree 4`` given ``parts_name``) or
    ``index`` is out of range.
    """
    if parts < 1 or total % parts:
        into = f"over {parts_name} {parts}" if parts_name else f"into {parts} equal parts"
        raise ValueError(f"a {what} {total} {unit} cannot be split {into}")
    if not 0 <= index < parts:
        raise ValueError(f"part {index} out of range for {parts} parts")
    size = total // parts
    return slice(index * size, (index + 1) * size)
