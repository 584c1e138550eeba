"""The model's layers in order, by layer type, and which of them a partition puts on each stage and model chunk."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np


class LayerSequence:
    """The model's layers as layer-type indices, and which types a partition puts on each stage."""

    def __init__(self, num_layers_per_type: Sequence[int]) -> None:
        self.runs = [(t, count) for t, count in enumerate(num_layers_per_type)]  # (type, layers), in model order
        self.type_of = [t for t, count in self.runs for _ in range(count)]
        self.type_ends = [i + 1 == len(self.type_of) or self.type_of[i + 1] != t for i, t in enumerate(self.type_of)]
        self._counts: dict[tuple[tuple[int, ...], int | None], list[list[tuple[int, int]]]] = {}
        self._p2p: dict[tuple[tuple[int, ...], int], list[list[int]]] = {}
        self._chunks: dict[tuple[int, ...], list[range]] = {}
        self._stages: dict[tuple[tuple[int, ...], int | None], list[list[int]]] = {}

    def __len__(self) -> int:
        return len(self.type_of)

    def chunk_layers(self, division: Sequence[int]) -> list[range]:
        """Per model chunk (per stage when there is one chunk per stage), the global indices of its layers (cached:
        the search asks per plan it scores; read-only)."""
        key = tuple(division)
        hit = self._chunks.get(key)
        if hit is None:
            starts = np.cumsum([0, *division])
            hit = self._chunks[key] = [range(int(a), int(b)) for a, b in pairwise(starts)]
        return hit

    def stage_layers(self, division: Sequence[int], pp: int | None = None) -> list[list[int]]:
        """Per stage, the global indices of its layers in model order: the chunks ``s, s + pp, ...`` (chunk ``c``
        runs on stage ``c % pp``, galva_schema's ``Strategy.chunk_stage``); ``pp`` defaults to one chunk per stage."""
        key = (tuple(division), pp)
        hit = self._stages.get(key)
        if hit is None:
            pp = len(division) if pp is None else pp
            chunks = self.chunk_layers(division)
            hit = [[i for k in range(stage, len(chunks), pp) for i in chunks[k]] for stage in range(pp)]
            self._stages[key] = hit
        return hit

    def stage_types(self, division: Sequence[int], pp: int | None = None) -> list[list[int]]:
        """Per stage, the type index of each layer it holds."""
        return [[self.type_of[i] for i in indices] for indices in self.stage_layers(division, pp)]

    def stage_chunk_starts(self, division: Sequence[int], pp: int | None = None) -> list[list[int]]:
        """Per stage, the positions (in :meth:`stage_layers` order) where one of its chunks begins."""
        pp = len(division) if pp is None else pp
        out: list[list[int]] = [[] for _ in range(pp)]
        sizes = [0] * pp
        for k, count in enumerate(division):
            out[k % pp].append(sizes[k % pp])
            sizes[k % pp] += count
        return out

    def stage_p2p_types(self, division: tuple[int, ...], pp: int) -> list[list[int]]:
        """Per stage, the layer type of every p2p send it makes per micro-batch: at each boundary between model
        chunks the sender's stage sends the activation forward, the receiver's stage sends its gradient back, both
        sized by the layer before the boundary (cached)."""
        key = (division, -pp)
        hit = self._p2p.get(key)
        if hit is None:
            hit = [[] for _ in range(pp)]
            end = 0
            for k, count in enumerate(division[:-1]):
                end += count
                t = self.type_of[end - 1]
                hit[k % pp].append(t)
                hit[(k + 1) % pp].append(t)
            self._p2p[key] = hit
        return hit

    def stage_type_counts(self, division: tuple[int, ...], pp: int | None = None) -> list[list[tuple[int, int]]]:
        """Per stage, ``(type, count)`` of the layers it holds (cached: bounds ask for it per task)."""
        key = (division, pp)
        hit = self._counts.get(key)
        if hit is None:
            hit = []
            for types in self.stage_types(division, pp):
                counts: dict[int, int] = {}
                for t in types:
                    counts[t] = counts.get(t, 0) + 1
                hit.append(sorted(counts.items()))
            self._counts[key] = hit
        return hit
