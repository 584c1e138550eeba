"""Pipeline partitions: how many consecutive layers each stage holds (reference §6.3, generalised)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from galva_schema import even_division

__all__ = ["balanced_division", "even_division"]


def balanced_division(
    runs: Sequence[tuple[int, Sequence[float]]], extra: Sequence[float]
) -> list[int] | None:
    """Contiguous split of layers into ``len(extra)`` non-empty stages that minimises the largest stage load.

    ``runs`` lists the model's layers as runs of identical layers: ``(count, load_by_stage)``, where
    ``load_by_stage[s]`` is the load of one such layer on stage ``s`` (memory under 1F1B depends on the stage, since
    stage ``s`` holds ``min(pp - s, c)`` micro-batches). ``extra[s]`` is a fixed load of stage ``s`` (the vocabulary
    layers). Binary search on the bottleneck with a greedy fill, which is exact for a contiguous split: giving a
    stage as many layers as fit never makes the later stages worse off. Returns None when there are fewer layers than
    stages.
    """
    stages = len(extra)
    total = sum(count for count, _ in runs)
    if stages == 0 or total < stages:
        return None
    if len(runs) == 1 and all(w > 0 for w in runs[0][1]):
        fast = _one_run(total, runs[0][1], extra)
        if fast is not None:
            return fast

    def fill(cap: float) -> list[int] | None:
        out: list[int] = []
        run, used = 0, 0  # current run and how many of its layers are already placed
        placed = 0
        for stage in range(stages):
            load = extra[stage]
            count = 0
            limit = total - placed - (stages - stage - 1)  # leave one layer for every later stage
            while count < limit:
                left = runs[run][0] - used
                weight = runs[run][1][stage]
                if stage == stages - 1 or weight <= 0:
                    take = min(left, limit - count)
                else:
                    room = int((cap - load) // weight) if cap >= load else 0
                    take = min(left, limit - count, max(room, 0))
                    if take == 0 and count == 0:
                        take = 1  # a stage is never empty; the cap check below rejects it if it does not fit
                if take == 0:
                    break
                load += take * weight
                count += take
                used += take
                if used == runs[run][0]:
                    run, used = run + 1, 0
            if load > cap * (1 + 1e-12) or count == 0:
                return None
            out.append(count)
            placed += count
        return out if placed == total else None

    low = 0.0
    high = max(extra) + sum(count * max(load) for count, load in runs)
    best = fill(high)
    if best is None:
        return None
    for _ in range(64):
        mid = 0.5 * (low + high)
        got = fill(mid)
        if got is None:
            low = mid
        else:
            high, best = mid, got
        if high - low <= 1e-9 * max(1.0, high):
            break
    return best


def _one_run(total: int, weight: Sequence[float], extra: Sequence[float]) -> list[int] | None:
    """Identical layers: the smallest bottleneck is the smallest ``cap`` with
    ``sum_s floor((cap - extra_s) / weight_s) >= total``; start from the continuous solution and step through the
    next breakpoints (at most one per stage is ever needed per missing layer)."""
    stages = len(extra)

    def fits(cap: float) -> list[int]:
        return [max(0, math.floor((cap - x) / w + 1e-9)) for x, w in zip(extra, weight)]

    cap = (total + sum(x / w for x, w in zip(extra, weight))) / sum(1.0 / w for w in weight)
    cap = max(cap, max(x + w for x, w in zip(extra, weight)))  # every stage holds at least one layer
    counts = fits(cap)
    for _ in range(4 * stages + 4):
        if sum(counts) >= total:
            break
        cap = min(x + (k + 1) * w for x, w, k in zip(extra, weight, counts))
        counts = fits(cap)
    else:
        return None
    # greedy fill at that cap: earlier stages take what fits, the rest shrinks from the end
    out = []
    left = total
    for stage in range(stages):
        take = min(counts[stage], left - (stages - stage - 1))
        if take < 1:
            return None
        out.append(take)
        left -= take
    if left:
        return None
    return out
