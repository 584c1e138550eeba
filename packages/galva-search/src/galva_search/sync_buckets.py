"""ddp gradient sync priced per bucket, as galva-hp reduces it (docs/cost-model.md §3): the runtime puts consecutive
ddp units of one chunk, group and dtype into one all-reduce up to the cap (:func:`galva_comm.buckets.gradient_buckets`,
the rule both use). The model prices a ddp layer's sync as its share of the buckets that the layers of its type in its
model chunk form when they all run its candidate (:func:`bucket_share_s`): one number per layer and candidate, the
same in the stage DP's rows and in the plan's score (``evaluation.task_cost``), so the search stays exact in its own
model. The vocabulary layers' all-reduce is priced apart, as a bucket of its own (``VocabTerms.exposed_sync_s``).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from galva_comm.buckets import gradient_buckets
from galva_search.collectives import Collectives

if TYPE_CHECKING:
    from galva_search.layer_costs import LayerTerms


def bucket_share_s(
    comm: Collectives, terms: LayerTerms, count: int, cap_bytes: float, factor: float = 1.0
) -> np.ndarray:
    """Per candidate, the exposed gradient sync of one of ``count`` layers of a type in one model chunk: for a ddp
    candidate, the mean over the layers of what the buckets of ``count`` such layers cost (each bucket of ``k`` one
    all-reduce of ``k`` layers' bytes, scaled by ``factor``, the calibration's dp_comm, overlapped with their ``k``
    backwards: ``ov(k·g, t_AR(k·G)) − k·g``); so ``count`` layers of one candidate cost what galva-hp's buckets of
    them cost. ``terms.exposed_sync_s`` where no bucket holds two layers (layers of half the cap or more, cap 0, a
    single layer) and for every other candidate (ZeRO, one rank, routed experts)."""
    out = np.array(terms.exposed_sync_s, dtype=float)
    if count < 2 or not len(terms.bucket_bytes):
        return out
    for i in np.flatnonzero(terms.bucket_bytes > 0):
        nbytes = float(terms.bucket_bytes[i])
        sizes = Counter(len(m) for m in gradient_buckets([0] * count, [nbytes] * count, cap_bytes))
        if max(sizes) < 2:
            continue
        size, consecutive = terms.bucket_group[i]
        g = float(terms.backward_s[i])
        total = 0.0
        for k, n in sorted(sizes.items()):
            sync = float(comm.allreduce(int(size), bool(consecutive), k * nbytes)) * factor
            total += n * (float(comm.overlapped(k * g, sync)) - k * g)
        out[i] = total / count
    return out
