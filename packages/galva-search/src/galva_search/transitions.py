"""Moving activations between layers of different layouts (docs/cost-model.md §5), priced as the runtime moves them.

The runtime re-shards a boundary activation with :func:`galva_comm.layout.redistribution_plan` (one all-to-all of
uneven cells inside each connected group) forward, and the reverse plan on its gradient backward. The cost of a
transition is therefore the share of the micro-batch that the busiest rank sends or receives in the two plans,
asked of :func:`galva_comm.layout.busiest_rank_fraction` once per (stage size, source layout, target layout) and
memoised for the process, at the bus bandwidth of groups of the larger model-parallel degree (times cp) with the
layout of the wider side. Pairs with context parallelism are bounded instead (:func:`exchange_share`).

Each plan that moves anything is also one ``all_to_all_single`` call, whatever its size: a micro-batch pays that
call's latency once per direction (:func:`exchange_calls`), priced as the profile's all-to-all of groups of the wider
side at its smallest size, with the busy extra (the call follows the layer's compute); without an all-to-all curve in
the profile only the bytes are priced. On 2 gloo CPU ranks such a call took 1.7-2.1 ms in the step where the bytes
cost tens of microseconds: a plan switching between dp and tp layers (layer 0 ZeRO-3, layers 1-2 tp 2, layer 3 dp)
was priced 0.04 ms for its two calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def exchange_calls(stage_ranks: int, source: Layout, target: Layout) -> int:
    """Collective calls a micro-batch makes at a boundary from layout ``source`` to ``target``: one per direction
    (the forward plan, the backward's reverse plan) that moves cells between ranks; both for pairs with context
    parallelism (bounded as :func:`exchange_share`)."""
    if source == target:
        return 0
    if source[3] > 1 or target[3] > 1:
        return 2
    return int(_one_way(stage_ranks, source, target) > 0) + int(_one_way(stage_ranks, target, source) > 0)


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


def call_seconds(comm: Collectives, stage_ranks: int, source: Layout, target: Layout) -> float:
    """Seconds per micro-batch of the boundary's collective calls themselves (:func:`exchange_calls`), whatever the
    bytes: each an all-to-all's latency over groups of the wider side (:meth:`Collectives.all_to_all_latency`)."""
    calls = exchange_calls(stage_ranks, source, target)
    if calls == 0:
        return 0.0
    wide = max(source, target, key=lambda layout: layout[0] * layout[3])
    return calls * comm.all_to_all_latency(wide[0] * wide[3])


def redistribution_calls(
    comm: Collectives, candidates: Sequence[Candidate], stage_ranks: int, megatron_sp: bool
) -> np.ndarray:
    """``[S][S]`` seconds per micro-batch of the calls (:func:`call_seconds`) from candidate ``i`` to ``j``."""
    return _pairwise(
        [candidate_layout(c, stage_ranks, megatron_sp) for c in candidates],
        lambda a, b: call_seconds(comm, stage_ranks, a, b),
    )


def _pairwise(layouts: list[Layout], price: Callable[[Layout, Layout], float]) -> np.ndarray:
    """``price`` of every pair of ``layouts``, computed once per pair of distinct layouts."""
    distinct = list(dict.fromkeys(layouts))  # a dozen layouts for a hundred candidates
    small = np.array([[price(a, b) for b in distinct] for a in distinct])
    index = np.array([distinct.index(lay) for lay in layouts], dtype=int)
    return small[np.ix_(index, index)] if len(index) else np.zeros((0, 0))


def redistribution_per_sample(
    comm: Collectives, candidates: Sequence[Candidate], stage_ranks: int, megatron_sp: bool, sample_bytes: float
) -> np.ndarray:
    """``[S][S]`` seconds per sample of the micro-batch from candidate ``i`` to candidate ``j`` (``sample_bytes``:
    one sample's boundary activation, ``seq * hidden * element bytes``)."""
    return _pairwise(
        [candidate_layout(c, stage_ranks, megatron_sp) for c in candidates],
        lambda a, b: transfer_seconds(comm, stage_ranks, a, b, sample_bytes),
    )


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
    candidate of that layer (the bytes; :func:`vocab_boundary_calls` the calls)."""
    layouts = [candidate_layout(c, stage_ranks, megatron_sp) for c in candidates]
    into = np.array([transfer_seconds(comm, stage_ranks, vocab, lay, first_sample_bytes) for lay in layouts])
    out = np.array([transfer_seconds(comm, stage_ranks, lay, vocab, last_sample_bytes) for lay in layouts])
    return into, out


def vocab_boundary_calls(
    comm: Collectives, candidates: Sequence[Candidate], stage_ranks: int, megatron_sp: bool, vocab: Layout
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds per micro-batch of the calls (:func:`call_seconds`) from the embedding into the first layer, and from
    the last layer into the head, per candidate of that layer."""
    layouts = [candidate_layout(c, stage_ranks, megatron_sp) for c in candidates]
    into = np.array([call_seconds(comm, stage_ranks, vocab, lay) for lay in layouts])
    out = np.array([call_seconds(comm, stage_ranks, lay, vocab) for lay in layouts])
    return into, out


def switch_penalty(candidates: Sequence[Candidate], penalty_s: float) -> np.ndarray:
    """``[S][S]`` additive tie-breaker: ``penalty_s`` per change of ZeRO-3 or of checkpointing between neighbours,
    so that among plans of equal cost the one with fewest switches (contiguous runs) wins."""
    zero3 = np.array([c.dp_type is DataParallelType.ZERO3 for c in candidates])
    ckpt = np.array([c.checkpoint for c in candidates])
    changes = (zero3[:, None] != zero3[None, :]).astype(float) + (ckpt[:, None] != ckpt[None, :])
    return changes * penalty_s
