"""The global-batch contract between galva-models' data sources and galva-hp's runtime."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


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
    """Contiguous rows of ``batch`` for data-parallel rank ``dp_rank`` of ``dp_size``."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    if batch.size % dp_size:
        raise ValueError(f"a batch of {batch.size} samples cannot be split over data-parallel degree {dp_size}")
    per = batch.size // dp_size
    return batch.rows(dp_rank * per, (dp_rank + 1) * per)


def micro_batches(batch: Batch, count: int) -> list[Batch]:
    """Split ``batch`` into ``count`` contiguous micro-batches of equal size."""
    if count <= 0 or batch.size % count:
        raise ValueError(f"a batch of {batch.size} samples cannot be split into {count} micro-batches")
    per = batch.size // count
    return [batch.rows(i * per, (i + 1) * per) for i in range(count)]
