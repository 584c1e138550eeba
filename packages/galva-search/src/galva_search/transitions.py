"""Moving activations between layers of different layouts (docs/cost-model.md §5), priced as the runtime moves them.

The runtime re-shards a boundary activation with :func:`galva_comm.layout.redistribution_plan` (one all-to-all of
uneven cells inside each connected group) forward, and the reverse plan on its gradient backward. The cost of a
transition is therefore the share of the micro-batch that the busiest rank sends or receives in the two plans,
asked of :func:`galva_comm.layout.busiest_rank_fraction` once per (stage size, source layout, target layout) and
memoised for the process, at the bus bandwidth of groups of the larger model-parallel degree (times cp) with the
layout of the wider side. Pairs with context parallelism are bounded instead (:func:`exchange_share`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np

from galva_comm.layout import tp_consecutive
from galva_comm.shards import ShardLayout, busiest_rank_fraction
from galva_schema import DataParallelType
from galva_schema.sharding import sequence_shards
from galva_search.collectives import GB, Collectives
from galva_search.space import Candidate

Layout = tuple[int, bool, bool, int]
"""A boundary activation's layout on a stage: (model-parallel degree, consecutive group, sequence split, cp)."""


def candidate_layout(candidate: Candidate, stage_ranks: int, megatron_sp: bool) -> Layout:
    """The layout of a layer's boundary activation under ``candidate`` (as galva_comm.layout.RankLayout builds it)."""
    tp = candidate.tp
    split = sequence_shards(tp, ulysses=candidate.ulysses, megatron_sp=megatron_sp) > 1
    return tp, tp_consecutive(tp, stage_ranks, candidate.consecutive), split, candidate.cp


def vocab_layout(tp: int, sp: bool, megatron_sp: bool, cp: int = 1) -> Layout:
    """The layout of the vocabulary layers' boundary activation (their groups are always consecutive)."""
    return tp, True, sequence_shards(tp, ulysses=sp, megatron_sp=megatron_sp) > 1, cp


def exchange_share(stage_ranks: int, source: Layout, target: Layout) -> float:
    """Share of one micro-batch's boundary activation that the busiest rank sends or receives when a layer of
    layout ``source`` feeds one of layout ``target``: the forward plan plus the backward (reverse) plan."""
    if source == target:
        return 0.0
    if source[3] > 1 or target[3] > 1:
        # context parallelism: the busiest rank moves all it holds, both ways (an upper bound). galva_comm's exact
        # plans for every pair of cp layouts of a 64-rank stage take minutes; the boundary is small beside the ring
        return 2.0 * max(_held(stage_ranks, source), _held(stage_ranks, target))
    return _one_way(stage_ranks, source, target) + _one_way(stage_ranks, target, source)


def _held(stage_ranks: int, layout: Layout) -> float:
    """Share of a micro-batch's boundary activation one rank holds under ``layout``: ``1 / (dp cp)`` of it, over the
    model-parallel degree again where that splits the sequence (``dp cp = stage / degree``)."""
    degree, _, split, _ = layout
    return (1.0 if split else degree) / stage_ranks


@cache
def _one_way(stage_ranks: int, source: Layout, target: Layout) -> float:
    """galva_comm's answer for one plan, memoised for the process (a pair's forward is another pair's backward)."""
    ranks = tuple(range(stage_ranks))
    return float(busiest_rank_fraction(ShardLayout(ranks, *source), ShardLayout(ranks, *target)))


def transfer_seconds(
    comm: Collectives, stage_ranks: int, source: Layout, target: Layout, activation_bytes: float
) -> float:
    """Seconds to re-shard a micro-batch whose whole boundary activation is ``activation_bytes``, both ways."""
    share = exchange_share(stage_ranks, source, target)
    if share == 0.0:
        return 0.0
    wide = max(source, target, key=lambda layout: layout[0] * layout[3])  # the source on a tie
    return share * activation_bytes / (comm.bus_bandwidth_gb_per_s(wide[0] * wide[3], wide[1]) * GB)


def redistribution_per_sample(
    comm: Collectives, candidates: Sequence[Candidate], stage_ranks: int, megatron_sp: bool, sample_bytes: float
) -> np.ndarray:
    """``[S][S]`` seconds per sample of the micro-batch from candidate ``i`` to candidate ``j`` (``sample_bytes``:
    one sample's boundary activation, ``seq * hidden * element bytes``)."""
    layouts = [candidate_layout(c, stage_ranks, megatron_sp) for c in candidates]
    distinct = list(dict.fromkeys(layouts))  # a dozen layouts for a hundred candidates
    small = np.array([[transfer_seconds(comm, stage_ranks, a, b, sample_bytes) for b in distinct] for a in distinct])
    index = np.array([distinct.index(lay) for lay in layouts], dtype=int)
    return small[np.ix_(index, index)] if len(index) else np.zeros((0, 0))


def vocab_boundaries_per_sample(
    comm: Collectives,
    candidates: Sequence[Candidate],
    stage_ranks: int,
    megatron_sp: bool,
    vocab: Layout,
    first_sample_bytes: float,
    last_sample_bytes: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds per sample from the embedding into the first layer, and from the last layer into the head, per
    candidate of that layer."""
    layouts = [candidate_layout(c, stage_ranks, megatron_sp) for c in candidates]
    into = np.array([transfer_seconds(comm, stage_ranks, vocab, lay, first_sample_bytes) for lay in layouts])
    out = np.array([transfer_seconds(comm, stage_ranks, lay, vocab, last_sample_bytes) for lay in layouts])
    return into, out


def switch_penalty(candidates: Sequence[Candidate], penalty_s: float) -> np.ndarray:
    """``[S][S]`` additive tie-breaker: ``penalty_s`` per change of ZeRO-3 or of checkpointing between neighbours,
    so that among plans of equal cost the one with fewest switches (contiguous runs) wins."""
    zero3 = np.array([c.dp_type is DataParallelType.ZERO3 for c in candidates])
    ckpt = np.array([c.checkpoint for c in candidates])
    changes = (zero3[:, None] != zero3[None, :]).astype(float) + (ckpt[:, None] != ckpt[None, :])
    return changes * penalty_s
