"""Token windows over a Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``), read with megatron-core.

The dataset is megatron-core's :class:`~megatron.core.datasets.indexed_dataset.IndexedDataset` (memory-mapped,
no process groups, no compiled helpers needed). On top of it Galva builds GPT-style samples itself: the documents
are read as one token stream, cut into non-overlapping windows of ``seq_length + 1`` tokens (a window may span
documents, as in Megatron's GPT dataset), and each epoch visits the windows in an order shuffled by
``numpy.random.default_rng((seed, epoch))``. So sample ``i`` depends only on the files, ``seq_length``, ``seed``
and ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from galva_hp.megatron_import import import_megatron
from galva_models.data.loader import Batch


def _open(prefix: str) -> Any:
    IndexedDataset = import_megatron("megatron.core.datasets.indexed_dataset").IndexedDataset

    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise FileNotFoundError(f"{prefix}{suffix}: no such file (expected a Megatron indexed dataset prefix)")
    return IndexedDataset(prefix, mmap=True)


@dataclass
class TokenWindows:
    """Deterministic ``[seq_length + 1]`` token windows over an indexed dataset."""

    prefix: str
    seq_length: int
    seed: int = 1234
    _dataset: Any = field(init=False, repr=False)
    _starts: np.ndarray = field(init=False, repr=False)
    _orders: dict[int, np.ndarray] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._dataset = _open(self.prefix)
        lengths = np.asarray(self._dataset.sequence_lengths, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])
        self.num_tokens = int(self._starts[-1])
        self.num_windows = (self.num_tokens - 1) // self.seq_length
        if self.num_windows < 1:
            raise ValueError(
                f"{self.prefix}: {self.num_tokens} tokens are too few for one sample of seq_length {self.seq_length}"
            )

    def tokens(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens of the concatenated stream from position ``start``."""
        out = np.empty(count, dtype=np.int64)
        filled, pos = 0, start
        seq = int(np.searchsorted(self._starts, pos, side="right") - 1)
        while filled < count:
            offset = pos - int(self._starts[seq])
            take = min(count - filled, int(self._starts[seq + 1]) - pos)
            if take > 0:
                out[filled : filled + take] = self._dataset.get(seq, offset=offset, length=take)
                filled += take
                pos += take
            seq += 1
        return out

    def window(self, index: int) -> np.ndarray:
        """Sample ``index`` (any non-negative integer; epochs wrap around with a new shuffle)."""
        epoch, within = divmod(index, self.num_windows)
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng((self.seed, epoch)).permutation(self.num_windows)
            self._orders = {epoch: order}  # keep one epoch: steps move forward
        return self.tokens(int(order[within]) * self.seq_length, self.seq_length + 1)


@dataclass
class IndexedTokenSource:
    """Causal-LM global batches from an indexed dataset: step ``t`` holds samples ``[t*B, (t+1)*B)``."""

    prefix: str
    seq_length: int
    global_batch_size: int
    seed: int = 1234

    def __post_init__(self) -> None:
        self.windows = TokenWindows(self.prefix, self.seq_length, self.seed)

    def batch(self, step: int) -> Batch:
        first = step * self.global_batch_size
        rows = [self.windows.window(first + i) for i in range(self.global_batch_size)]
        tokens = torch.from_numpy(np.stack(rows))
        return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def check_dataset(prefix: str, vocab_size: int | None = None) -> int:
    """Check ``PREFIX.bin`` / ``PREFIX.idx`` before the first step: both exist, the index reads, the data file holds
    every token the index points at, and (with ``vocab_size``) no token id is beyond the vocabulary. Returns the
    number of tokens; raises :class:`ValueError` with one line naming the file."""
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    for path in (bin_path, idx_path):
        if not path.is_file():
            raise ValueError(f"{path}: no such file (expected a Megatron indexed dataset prefix)")
    _IndexReader = import_megatron("megatron.core.datasets.indexed_dataset")._IndexReader

    try:
        index = _IndexReader(str(idx_path), multimodal=False)
        lengths = np.asarray(index.sequence_lengths, dtype=np.int64)
        pointers = np.asarray(index.sequence_pointers, dtype=np.int64)
        itemsize = np.dtype(index.dtype).itemsize
    except Exception as err:  # a truncated or foreign index fails anywhere inside the reader
        detail = (str(err).splitlines() or [type(err).__name__])[0]
        raise ValueError(f"{idx_path}: not a readable Megatron index (truncated?): {detail}") from None
    needed = int(pointers[-1] + lengths[-1] * itemsize) if len(lengths) else 0
    size = bin_path.stat().st_size
    if size < needed:
        raise ValueError(f"{bin_path}: truncated: {size} bytes, the index points at {needed}")
    tokens = int(lengths.sum())
    if vocab_size is not None and tokens:
        data = np.memmap(bin_path, dtype=index.dtype, mode="r", shape=(needed // itemsize,))
        top = int(data.max())
        if top >= vocab_size:
            raise ValueError(
                f"{bin_path}: token id {top} is beyond the model's vocabulary of {vocab_size} "
                "(tokenised with another tokenizer? --vocab-size)"
            )
    return tokens
