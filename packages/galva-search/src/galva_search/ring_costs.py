"""Context parallelism's ring attention, priced per layer (docs/cost-model.md §3.4).

A layer under cp holds ``seq / cp`` tokens of its local samples (two chunks: its linear parts, norms and kept
activations all scale by ``1 / cp``; the balanced chunks give every rank ``1 / cp`` of the causal pairs too). Its
attention runs ``cp`` ring steps: each computes one key/value block while the next block travels to the ring
neighbour, so a step lasts the larger of the two, plus what the overlap slows (``Collectives.overlapped``). Forward
sends the key/value blocks (``cp - 1`` transfers), backward the key/value blocks and their gradients (twice the
bytes against ``backward_coefficient`` times the block's compute); a checkpointed layer rings its forward again.

Where the profile measured no attention core (``LayerTypeProfile.attention_core`` absent), the core is the
quadratic term ``a s^2`` of a sequence forward time and nothing otherwise (every transfer then exposed), and a
token carries ``2 x hidden_size`` key/value numbers (no grouped heads).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from galva_schema import LayerTypeProfile, SchemaError, SequenceTime
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
    steps = cp - 1
    forward = steps * (comm.overlapped(compute, transfer) - compute)
    block_backward = backward_coefficient * compute
    backward = steps * (comm.overlapped(block_backward, 2.0 * transfer) - block_backward)
    recompute = np.array([c.checkpoint for c in candidates])
    exposed = np.where(ring, forward * np.where(recompute, 2.0, 1.0) + backward, 0.0)
    # its own block, the one arriving and (backward) the travelling key/value gradients
    buffer = np.where(ring, 3.0 * block_bytes / MIB, 0.0)
    return exposed, buffer
