"""The two rules that say what part of the data a rank holds. Defined here once; every package asks these.

- **Batch share**: a batch is cut into equal *contiguous* blocks, micro-batch ``k`` of ``n`` is the ``k``-th block
  of the global batch, and data-parallel index ``d`` of ``dp`` holds the ``d``-th block of a micro-batch; a
  sequence-sharded rank holds the ``p``-th contiguous block of the sequence (:func:`contiguous_block`).
- **Sequence sharding**: a layer's boundary activations are split along the sequence over its model-parallel group
  when it runs Ulysses (or the vocabulary layers run sequence parallel), or when Megatron-SP is on and its tp
  degree is above 1; otherwise every rank of the group holds the whole sequence (:func:`sequence_shards`).
- **Context parallelism** (degree ``cp`` > 1, load-balanced for causal masks): the sequence is cut into ``2 cp``
  equal chunks and context-parallel index ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, in that order (one early,
  one late: every rank attends over the same number of causal pairs). Its *context-local* sequence is those two
  chunks concatenated; the sequence sharding above then splits that local sequence contiguously
  (:func:`context_chunks`, :func:`sequence_cells`, :func:`sequence_blocks`).
"""

from __future__ import annotations

__all__ = [
    "context_chunks",
    "contiguous_block",
    "sequence_blocks",
    "sequence_cell_count",
    "sequence_cells",
    "sequence_shards",
]


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


def context_chunks(cp: int, index: int) -> tuple[int, ...]:
    """The sequence chunks (of ``2 cp``, or the one whole sequence when ``cp`` is 1) context-parallel index
    ``index`` holds, in its local order: ``(index, 2 cp - 1 - index)``."""
    if not 0 <= index < cp:
        raise ValueError(f"context-parallel index {index} out of range for degree {cp}")
    return (0,) if cp == 1 else (index, 2 * cp - 1 - index)


def sequence_cell_count(cp: int, shards: int) -> int:
    """Cells of the finest grid that both rules cut the sequence into: ``shards`` per chunk."""
    return shards if cp == 1 else 2 * cp * shards


def sequence_cells(cp: int, shards: int, cp_index: int, shard_index: int) -> tuple[int, ...]:
    """The cells (of :func:`sequence_cell_count`) a rank holds at a layer boundary, in its local order.

    ``cp_index`` is its context-parallel index, ``shard_index`` its index among the ``shards`` sequence shards of
    its model-parallel group (:func:`sequence_shards`), which split the context-local sequence contiguously.
    """
    if not 0 <= shard_index < shards:
        raise ValueError(f"sequence shard {shard_index} out of range for {shards} shards")
    chunks = context_chunks(cp, cp_index)
    local = [chunk * shards + k for chunk in chunks for k in range(shards)]
    per = len(chunks)  # cells per shard of the local sequence
    return tuple(local[shard_index * per : (shard_index + 1) * per])


def sequence_blocks(seq_len: int, cp: int, shards: int, cp_index: int, shard_index: int) -> tuple[slice, ...]:
    """The positions of a ``seq_len``-token sequence a rank holds (:func:`sequence_cells`), as contiguous slices in
    its local order (adjacent cells merged).

    Raises ``ValueError`` with one line when the cells do not divide the sequence.
    """
    cells = sequence_cell_count(cp, shards)
    if seq_len % cells:
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be split into {cells} equal parts "
            f"(context-parallel degree {cp} x {shards} sequence shards{' x 2 chunks' if cp > 1 else ''})"
        )
    size = seq_len // cells
    out: list[slice] = []
    for cell in sequence_cells(cp, shards, cp_index, shard_index):
        start = cell * size
        if out and out[-1].stop == start:
            out[-1] = slice(out[-1].start, start + size)
        else:
            out.append(slice(start, start + size))
    return tuple(out)
