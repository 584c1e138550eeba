"""The global-batch contract between galva-models' data sources and galva-hp's runtime.

Which rows a rank holds is galva-schema's rule (:func:`galva_schema.sharding.contiguous_block`); :func:`dp_share`
and :func:`micro_batches` apply it to a :class:`Batch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from galva_schema.sharding import contiguous_block


@dataclass(frozen=True)
class Batch:
    """One global batch: ``inputs`` (token ids ``[B, S]`` or pixels ``[B, C, H, W]``) and ``labels``.

    For language models ``labels[b, s]`` is the target of position ``s`` (already shifted; ``-100`` = no loss).
    For image classification ``labels`` is ``[B]``.
    """

    inputs: Tensor
    labels: Tensor

    @property
    def size(self) -> int:
        return int(self.inputs.shape[0])

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(self.inputs[start:stop], self.labels[start:stop])


class GlobalBatchSource(Protocol):
    """Gives every rank the same global batch for a step (see :mod:`galva_models.data`)."""

    global_batch_size: int

    def batch(self, step: int) -> Batch:
        """The global batch of optimizer step ``step`` (0-based). Deterministic; identical on every rank."""
        ...


def dp_share(batch: Batch, dp_rank: int, dp_size: int) -> Batch:
    """Data-parallel rank ``dp_rank`` of ``dp_size``'s rows of ``batch`` (galva-schema's batch-share rule)."""
    rows = contiguous_block(batch.size, dp_size, dp_rank, parts_name="data-parallel degree")
    return batch.rows(rows.start, rows.stop)


def micro_batches(batch: Batch, count: int) -> list[Batch]:
    """``batch`` cut into ``count`` micro-batches (galva-schema's batch-share rule)."""
    blocks = [contiguous_block(batch.size, count, k, what="batch of") for k in range(max(count, 1))]
    return [batch.rows(rows.start, rows.stop) for rows in blocks]
