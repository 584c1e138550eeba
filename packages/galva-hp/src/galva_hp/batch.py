"""Which part of the global batch a rank feeds in: micro-batch by micro-batch, its data-parallel (and sequence) share.

Every rank receives the same global batch ``[batch, seq]``. Micro-batch ``k`` is the ``k``-th contiguous block of
``batch / num_micro_batches`` samples; inside it a rank of a :class:`~galva_comm.layout.ShardLayout` keeps the
contiguous block of its data-parallel index and, when the layout splits the sequence, the slice of its
model-parallel index: the same cells :func:`galva_comm.layout.redistribution_plan` moves between layers.
"""

from __future__ import annotations

from torch import Tensor

from galva_comm.layout import ShardLayout

__all__ = ["micro_batch", "shard_for"]


def micro_batch(batch: Tensor, index: int, count: int) -> Tensor:
    """Micro-batch ``index`` of ``count`` (contiguous blocks along dim 0)."""
    if batch.shape[0] % count:
        raise ValueError(f"a batch of {batch.shape[0]} samples cannot be cut into {count} micro-batches")
    size = batch.shape[0] // count
    return batch[index * size : (index + 1) * size]


def shard_for(tensor: Tensor, layout: ShardLayout, rank: int, split_sequence: bool) -> Tensor:
    """``rank``'s share of a ``[batch, seq, ...]`` tensor under ``layout`` (sequence split only if asked)."""
    batch_part, seq_part = layout.shard(rank)
    if tensor.shape[0] % layout.dp:
        raise ValueError(f"a micro-batch of {tensor.shape[0]} samples cannot be split over dp {layout.dp}")
    rows = tensor.shape[0] // layout.dp
    out = tensor[batch_part * rows : (batch_part + 1) * rows]
    if split_sequence and layout.seq_parts > 1:
        if tensor.shape[1] % layout.seq_parts:
            raise ValueError(f"sequence of {tensor.shape[1]} cannot be split into {layout.seq_parts} parts")
        cols = tensor.shape[1] // layout.seq_parts
        out = out[:, seq_part * cols : (seq_part + 1) * cols]
    return out.contiguous()
