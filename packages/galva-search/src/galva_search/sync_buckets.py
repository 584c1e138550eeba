"""ddp gradient sync priced per bucket, as galva-hp reduces it (docs/cost-model.md §3): the layers' and vocabulary
layers' terms price one all-reduce each; the runtime puts consecutive ddp units of one chunk and group into one
all-reduce up to the cap (:func:`galva_comm.buckets.gradient_buckets`, the rule both use). A plan's score re-prices
each bucket of several units as one all-reduce of their summed bytes, overlapped with their summed backward (the
per-layer form's convention: ``ov(g, t) − g``); a bucket of one unit keeps its own term unchanged. The stage DP's
rows are per layer: they take a layer's share of a bucket of the stage's layers of its type (:func:`run_share_s`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from galva_comm.buckets import gradient_buckets
from galva_search.collectives import Collectives

if TYPE_CHECKING:
    from galva_search.layer_costs import LayerTerms


@dataclass(frozen=True)
class SyncUnit:
    """One ddp unit's gradient all-reduce as its terms price it: the key the runtime buckets by (model chunk, group
    size, consecutive group), the bytes reduced, the backward it overlaps and the exposed time already priced."""

    chunk: int
    group_size: int
    consecutive: bool
    nbytes: float
    backward_s: float
    exposed_s: float


def bucket_correction_s(comm: Collectives, units: list[SyncUnit], cap_bytes: float, factor: float = 1.0) -> float:
    """Seconds to add to a stage's exposed gradient sync (``≤ 0`` when buckets save latencies) for its ``units`` in
    backward order: each bucket of several units priced as one all-reduce (``factor``: the calibration's dp_comm)
    instead of one per unit."""
    keys = [(u.chunk, u.group_size, u.consecutive) for u in units]
    delta = 0.0
    for members in gradient_buckets(keys, [u.nbytes for u in units], cap_bytes):
        if len(members) < 2:
            continue
        first = units[members[0]]
        nbytes = sum(units[i].nbytes for i in members)
        backward = sum(units[i].backward_s for i in members)
        sync = float(comm.allreduce(first.group_size, first.consecutive, nbytes)) * factor
        delta += float(comm.overlapped(backward, sync)) - backward - sum(units[i].exposed_s for i in members)
    return delta


def run_share_s(comm: Collectives, terms: LayerTerms, count: int, cap_bytes: float, factor: float = 1.0) -> np.ndarray:
    """Per candidate, the exposed sync of one layer for the stage DP, whose rows are per layer: a ddp candidate's
    share of a bucket of ``k`` such layers (``k`` as many as the cap holds, at most the stage's ``count`` layers of
    the type), so a stage of one candidate is priced as the score prices its buckets; ``terms.exposed_sync_s``
    elsewhere (and where ``k`` is 1: layers of half the cap or more)."""
    out = np.array(terms.exposed_sync_s, dtype=float)
    if not len(terms.bucket_bytes):
        return out
    for i in np.flatnonzero(terms.bucket_bytes > 0):
        nbytes = float(terms.bucket_bytes[i])
        k = max(1, min(count, int(cap_bytes // nbytes)))
        if k < 2:
            continue
        size, consecutive = terms.bucket_group[i]
        backward = k * float(terms.backward_s[i])
        sync = float(comm.allreduce(int(size), bool(consecutive), k * nbytes)) * factor
        out[i] = (float(comm.overlapped(backward, sync)) - backward) / k
    return out
