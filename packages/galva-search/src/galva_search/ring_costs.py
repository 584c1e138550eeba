"""Context parallelism's ring attention, priced per layer (docs/cost-model.md §3.4).

A layer under cp holds ``seq / cp`` tokens of its local samples (two chunks: its linear parts, norms and kept
activations all scale by ``1 / cp``; the balanced chunks give every rank ``1 / cp`` of the causal pairs too). Its
attention runs ``cp`` ring steps: each computes one key/value block while the next block travels to the ring
neighbour, so a step lasts the larger of the two, plus what the overlap slows (``Collectives.overlapped``). Forward
sends the key/value blocks (``cp - 1`` transfers), backward the key/value blocks and their gradients (twice the
bytes against ``backward_coefficient`` times the block's compute); a checkpointed layer rings its forward again.

A sliding window (``AttentionCoreProfile.window``, on ``window_layers`` of the type's layers) leaves a rank's ring
steps uneven: a step whose block lies outside the window computes nothing while its transfer still travels (the ring
passes every block), and the rank holding the late chunk attends fewer pairs than the whole-sequence balance gives
it. Each windowed step is priced from the exact pair count of its block (:func:`step_shares`), each rank's steps in
turn, and the layer waits for its slowest rank.

Where the profile measured no attention core (``LayerTypeProfile.attention_core`` absent), the core is the
quadratic term ``a s^2`` of a sequence forward time and nothing otherwise (every transfer then exposed), and a
token carries ``2 x hidden_size`` key/value numbers (no grouped heads).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from galva_schema import AttentionCoreProfile, LayerTypeProfile, SchemaError, SequenceTime
from galva_schema.sharding import context_chunks
from galva_search.collectives import GB, MIB, Collectives
from galva_search.space import Candidate


def core_ms_per_sample(layer: LayerTypeProfile) -> float:
    """Forward ms of one sample's attention core at the layer's sequence length (tp 1, cp 1)."""
    s = layer.seq_length
    if layer.attention_core is not None:
        a, b, c = layer.attention_core.forward_time.coefficients
        return max(0.0, a * s * s + b * s + c)
    if isinstance(layer.forward_time, SequenceTime):
        return max(0.0, layer.forward_time.coefficients[0] * s * s)
    return 0.0


def kv_bytes_per_token(layer: LayerTypeProfile, element_bytes: int) -> float:
    """Key/value bytes of one token at tp 1 in the search's precision."""
    if layer.attention_core is not None:
        return float(layer.attention_core.kv_bytes_per_token)
    return 2.0 * layer.hidden_size * element_bytes


def ring_bandwidth_gb_per_s(comm: Collectives, distance: int) -> float:
    """Bandwidth of a ring link ``distance`` ranks long: the profile's p2p of the pipeline whose neighbouring
    stages are that far apart, else the nearest measured degree."""
    entries = {entry.pp: entry.bandwidth_gb_per_s for entry in comm.profile.p2p}
    if not entries:
        raise SchemaError("p2p: no entry; the search prices context parallelism's ring by it", source=comm.source)
    want = max(2, comm.world_size // max(1, distance))
    return float(entries[min(entries, key=lambda pp: (abs(np.log2(pp / want)), -pp))])


def ring_terms(
    layer: LayerTypeProfile,
    candidates: Sequence[Candidate],
    local: np.ndarray,
    comm: Collectives,
    bandwidth_gb_per_s: np.ndarray,
    element_bytes: int,
    backward_coefficient: float,
    compute_factor: float,
) -> tuple[np.ndarray, np.ndarray]:
    """``(exposed seconds per micro-batch, key/value buffer MiB held while the layer runs)`` per candidate, for
    ``local`` samples per rank; zero where ``cp == 1``."""
    n = len(candidates)
    cp = np.array([c.cp for c in candidates], dtype=float)
    mp = np.array([c.tp for c in candidates], dtype=float)  # heads split over Megatron tp or Ulysses alike
    ring = cp > 1
    exposed, buffer = np.zeros(n), np.zeros(n)
    if not ring.any():
        return exposed, buffer
    block_bytes = local * (layer.seq_length / cp) * kv_bytes_per_token(layer, element_bytes) / mp
    transfer = block_bytes / (np.asarray(bandwidth_gb_per_s, dtype=float) * GB)
    # one step's block: 1 / cp of the rank's 1 / cp share of the pairs (its heads: 1 / mp)
    compute = local * core_ms_per_sample(layer) * 1e-3 * compute_factor / (mp * cp * cp)
    recompute = np.array([c.checkpoint for c in candidates])
    forward, backward = _balanced_steps(compute, transfer, cp, comm, backward_coefficient)
    exposed = forward * np.where(recompute, 2.0, 1.0) + backward
    windowed = _windowed_share(layer)
    if windowed > 0.0:
        assert layer.attention_core is not None and layer.attention_core.window is not None
        core = local * core_ms_per_sample(layer) * 1e-3 * compute_factor / mp  # every pair, its heads
        forward, backward = _windowed_steps(
            core, transfer, cp, comm, backward_coefficient, layer.seq_length, layer.attention_core
        )
        exposed = (1.0 - windowed) * exposed + windowed * (forward * np.where(recompute, 2.0, 1.0) + backward)
    exposed = np.where(ring, exposed, 0.0)
    # its own block, the one arriving and (backward) the travelling key/value gradients
    buffer = np.where(ring, 3.0 * block_bytes / MIB, 0.0)
    return exposed, buffer


def _balanced_steps(
    compute: np.ndarray, transfer: np.ndarray, cp: np.ndarray, comm: Collectives, backward_coefficient: float
) -> tuple[np.ndarray, np.ndarray]:
    """Exposed forward and backward seconds of ``cp - 1`` alike steps, each computing ``compute`` (the balanced
    chunks give every step of every rank ``1 / cp`` of the rank's ``1 / cp`` share of the pairs)."""
    steps = cp - 1
    forward = steps * (comm.overlapped(compute, transfer) - compute)
    block_backward = backward_coefficient * compute
    return forward, steps * (comm.overlapped(block_backward, 2.0 * transfer) - block_backward)


def _windowed_share(layer: LayerTypeProfile) -> float:
    """The share of the type's layers whose window is shorter than the sequence (0 without a window)."""
    core = layer.attention_core
    if core is None or core.window is None or core.window >= layer.seq_length:
        return 0.0
    return min(1.0, core.window_layers / layer.num_layers)


def _windowed_steps(
    core: np.ndarray,
    transfer: np.ndarray,
    cp: np.ndarray,
    comm: Collectives,
    backward_coefficient: float,
    seq: int,
    attention: AttentionCoreProfile,
) -> tuple[np.ndarray, np.ndarray]:
    """Exposed forward and backward seconds of a windowed layer's ring: each rank's steps priced from their own
    pair counts, the slowest rank's steps and its compute above the mean (which the layer's compute counts)."""
    forward, backward = np.zeros(len(core)), np.zeros(len(core))
    assert attention.window is not None
    for degree in np.unique(cp[cp > 1]).astype(int):
        at = cp == degree
        shares = step_shares(seq, int(degree), attention.causal, attention.window)
        mean = shares.sum(axis=1).mean()
        worst_f, worst_b = np.full(at.sum(), -np.inf), np.full(at.sum(), -np.inf)
        for row in shares:
            c = core[at][:, None] * row[None, :]  # [candidates, steps]: step 0 is the rank's own block
            b = backward_coefficient * c
            t = transfer[at][:, None]
            excess = core[at] * (row.sum() - mean)  # this rank's compute above the mean
            own_f = excess + (comm.overlapped(c[:, 1:], t) - c[:, 1:]).sum(axis=1)
            own_b = backward_coefficient * excess + (comm.overlapped(b[:, 1:], 2.0 * t) - b[:, 1:]).sum(axis=1)
            worst_f, worst_b = np.maximum(worst_f, own_f), np.maximum(worst_b, own_b)
        forward[at], backward[at] = worst_f, worst_b
    return forward, backward


@lru_cache(maxsize=256)
def step_shares(seq: int, cp: int, causal: bool, window: int | None) -> np.ndarray:
    """``[rank, step]``: the share of the sequence's pairs (causal: ``q >= k``; bidirectional: every pair, no window)
    that context-parallel rank ``rank`` computes at ring step ``step`` (step 0: its own chunks; step ``j``: the chunks
    of rank ``rank - j``), with the balanced two-chunk layout of :func:`galva_schema.sharding.context_chunks` and a
    query attending to keys fewer than ``window`` positions away (None: any)."""
    size = seq / (2 * cp)
    reach = np.inf if window is None else window - 1  # largest |q - k| that attends
    low, high = (0.0, reach) if causal else (-reach, reach)
    whole = seq * (seq + 1) / 2 if causal else float(seq) * seq
    out = np.zeros((cp, cp))
    for rank in range(cp):
        mine = [(c * size, (c + 1) * size) for c in context_chunks(cp, rank)]
        for step in range(cp):
            theirs = [(c * size, (c + 1) * size) for c in context_chunks(cp, (rank - step) % cp)]
            out[rank, step] = sum(_pairs(q, k, low, high) for q in mine for k in theirs) / whole
    out.setflags(write=False)
    return out


def _pairs(queries: tuple[float, float], keys: tuple[float, float], low: float, high: float) -> float:
    """Pairs ``(q, k)`` of the two position ranges ``[start, stop)`` with ``low <= q - k <= high``."""
    return _pairs_up_to(queries, keys, high) - _pairs_up_to(queries, keys, low - 1)


def _pairs_up_to(queries: tuple[float, float], keys: tuple[float, float], gap: float) -> float:
    """Pairs with ``q - k <= gap``: for each query ``q``, the keys ``k >= q - gap``, i.e. ``clip(k1 - x, 0, m)`` at
    ``x = q - gap``, summed over the queries as a piecewise-linear series."""
    (q0, q1), (k0, k1) = queries, keys
    m = k1 - k0
    if gap == np.inf:
        return (q1 - q0) * m
    if gap == -np.inf:
        return 0.0
    x0, x1 = q0 - gap, q1 - gap  # x runs over [x0, x1)
    full = max(0.0, min(x1, k0 + 1) - x0) * m  # x <= k0: every key
    b0, b1 = max(x0, k0 + 1), min(x1, k1)  # k0 < x < k1: k1 - x keys
    n = max(0.0, b1 - b0)
    return full + n * k1 - (b0 + b1 - 1) * n / 2
