"""Which part of the global batch a rank feeds in: micro-batch by micro-batch, its data-parallel (and sequence) share.

Every rank receives the same global batch ``[batch, seq]``. Micro-batch ``k`` is the ``k``-th contiguous block of
``batch / num_micro_batches`` samples; inside it a rank of a :class:`~galva_comm.layout.ShardLayout` keeps the
contiguous block of its data-parallel index and, under context parallelism, its two chunks of the sequence; when
the layout splits the sequence over its model-parallel group, the slice of its model-parallel index: the same cells
:func:`galva_comm.layout.redistribution_plan` moves between layers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from galva_comm.shards import ShardLayout
from galva_schema.sharding import contiguous_block

__all__ = ["micro_batch", "shard_for"]


def micro_batch(batch: Tensor, index: int, count: int) -> Tensor:
    """Micro-batch ``index`` of ``count`` (contiguous blocks along dim 0)."""
    return batch[contiguous_block(batch.shape[0], count, index)]


def shard_for(
    tensor: Tensor, layout: ShardLayout, rank: int, split_sequence: bool, *, context: bool = True
) -> Tensor:
    """``rank``'s share of a ``[batch, seq, ...]`` tensor under ``layout``: its context-parallel chunks (unless
    ``context`` is false: a tensor without a sequence), and its slice of them over the model-parallel group only if
    ``split_sequence``."""
    out = tensor[layout.batch_rows(rank, tensor.shape[0])]
    if split_sequence or (context and layout.cp > 1):
        blocks = layout.seq_blocks(rank, tensor.shape[1], split=split_sequence)
        out = torch.cat([out[:, block] for block in blocks], dim=1)
    return out.contiguous()
