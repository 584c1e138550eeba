"""What a mixture-of-experts layer's routed experts add to its costs under each candidate's expert layout
(docs/cost-model.md §3.5), from the layer type's :class:`galva_schema.ExpertProfile`.

The layer's own profile is the whole layer at ep 1 (every expert on the rank, the experts' block seeing this rank's
``1/tp`` of the tokens, as galva-models runs it under tp and Ulysses alike). Relative to that:

* **states**: the routed experts are ``expert_parameter_mib / (ep * etp)`` per rank, held under the expert
  data-parallel type over ``expert dp = stage ranks / (ep * etp)``; the experts' block (router, shared experts) is
  replicated over tp; the rest of the layer follows tp and the layer's dp type as a dense layer does.
* **compute**: the rank computes the rows its experts receive, ``rows * imbalance(ep)`` at the measured per-row
  time, and pays each of its ``E / ep`` experts' per-call time (instead of ``E`` of them).
* **dispatch / combine**: 2 all-to-alls over the ep group forward, 2 backward (2 more when recomputing), each of the
  rank's ``rows x hidden`` buffer, and 3 small ones (row counts; routing weights forward and backward; 2 more when
  recomputing); under etp the rows are gathered over the etp group and the partial outputs
  summed back (an all-gather and a reduce-scatter per pass).
* **activations**: dispatch and combine keep their measured bytes per row more under ep > 1; the routed rows a rank
  keeps exceed the mean by the imbalance of its rows summed over the stage's layers (a rank's busiest layers
  differ): from the profile's per-forward figures over all the type's layers (``memory_imbalance``), the expected
  largest of the stage's expert-dp groups (each routes its own tokens), its excess over 1 scaled by
  ``sqrt(routed_tokens / tokens the ep group routes)`` (routing noise shrinks as ``1/sqrt(tokens)``) and by
  ``sqrt(pp)`` (a stage holds ``1/pp`` of the layers, whose routers choose independently), at most one layer's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from galva_schema import DataParallelType, ExpertProfile, LayerTypeProfile
from galva_search.space import Candidate


def imbalance(experts: ExpertProfile, ep: int) -> float:
    """Measured max/mean rows per rank at ``ep`` (the nearest measured degree below it where not measured)."""
    if ep in experts.imbalance:
        return experts.imbalance[ep]
    below = [d for d in experts.imbalance if d <= ep]
    return experts.imbalance[max(below)] if below else 1.0


def expected_largest(figures: Sequence[float], draws: int) -> float:
    """The expected largest of ``draws`` values drawn without replacement from ``figures``."""
    ordered = sorted(figures)
    n = len(ordered)
    draws = max(1, min(draws, n))
    total = math.comb(n, draws)
    return sum(x * math.comb(i, draws - 1) for i, x in enumerate(ordered)) / total


def memory_imbalance(layer: LayerTypeProfile, candidate: Candidate, local: float) -> float:
    """Max/mean routed rows a rank keeps over its stage's layers of this type, with ``local`` samples per rank
    (module docstring)."""
    experts = layer.experts
    assert experts is not None
    one = imbalance(experts, candidate.ep)
    figures = experts.memory_imbalance.get(candidate.ep)
    if not figures or not experts.routed_tokens:
        return one
    excess = expected_largest(figures, candidate.expert_dp) - 1.0
    excess = min(one - 1.0, excess * math.sqrt(min(candidate.pp, layer.num_layers)))
    pool = candidate.ep * local * layer.seq_length / (candidate.tp * candidate.cp)  # tokens the ep group routes
    return 1.0 + excess * math.sqrt(experts.routed_tokens / pool)


def expert_dp_type(candidate: Candidate) -> DataParallelType:
    """The data-parallel type of the candidate's expert replicas."""
    return candidate.expert_dp_type or candidate.dp_type


def parameter_split(layer: LayerTypeProfile, candidate: Candidate) -> tuple[float, float]:
    """``(rest, experts)``: parameter MiB (fp32 bytes) one rank holds of the layer outside the routed experts and of
    the routed experts, before any data-parallel sharding."""
    experts = layer.experts
    if experts is None:
        return layer.parameter_mib / candidate.tp_degree, 0.0
    dense = max(0.0, layer.parameter_mib - experts.expert_parameter_mib - experts.block_parameter_mib)
    rest = dense / candidate.tp_degree + experts.block_parameter_mib
    return rest, experts.expert_parameter_mib / (candidate.ep * candidate.etp)


def rows_per_sample(layer: LayerTypeProfile, candidate: Candidate) -> float:
    """Routed rows (token, expert) a rank's experts block dispatches per local sample: its ``1/tp`` of the tokens
    times top-k."""
    assert layer.experts is not None
    return layer.seq_length / candidate.tp * layer.experts.top_k


def extra_forward_seconds(layer: LayerTypeProfile, candidates: Sequence[Candidate], local: np.ndarray) -> np.ndarray:
    """Forward seconds the expert layout adds to (or saves from) the layer's ep-1 time, per candidate."""
    experts = layer.experts
    out = np.zeros(len(candidates))
    if experts is None:
        return out
    t = experts.expert_time
    for i, c in enumerate(candidates):
        rows = local[i] * rows_per_sample(layer, c)
        out[i] = t.slope_ms_per_sample * rows * (imbalance(experts, c.ep) - 1.0)
        out[i] += t.intercept_ms * (experts.num_experts / c.ep - experts.num_experts)
    return out * 1e-3


CommEntry = tuple[str, int, bool, int, float, float]


def comm_groups(layer: LayerTypeProfile, candidates: Sequence[Candidate]) -> list[CommEntry]:
    """``(collective, group size, consecutive, candidate index, buffer scale, count)`` of the expert collectives per
    micro-batch; the buffer is ``scale`` times the layer's ``[local, seq, hidden]`` activation bytes."""
    experts = layer.experts
    out: list[CommEntry] = []
    if experts is None:
        return out
    for i, c in enumerate(candidates):
        scale = experts.top_k / c.tp * imbalance(experts, c.ep)  # the busiest rank's rows
        passes = 3.0 if c.checkpoint else 2.0
        if c.ep > 1:  # ep groups are strided by etp (expert groups: etp fastest)
            out.append(("all_to_all", c.ep, c.etp == 1, i, scale, 2.0 * passes))
            # and the small ones, latency-bound: the row counts (forward), the routing weights (forward, backward)
            small = scale / layer.hidden_size
            out.append(("all_to_all", c.ep, c.etp == 1, i, small, 2.0 * passes - 1.0))
        if c.etp > 1:
            out.append(("all_gather", c.etp, True, i, scale, passes))
            out.append(("reduce_scatter", c.etp, True, i, scale * c.etp, passes))
    return out


def extra_activation_per_sample(layer: LayerTypeProfile, candidate: Candidate) -> float:
    """Activation MiB per local sample the expert layout adds to the layer's measured (ep 1) figure at an even
    routing: what dispatch and combine keep."""
    experts = layer.experts
    if experts is None or candidate.checkpoint or candidate.ep == 1:
        return 0.0
    return rows_per_sample(layer, candidate) * experts.dispatch_activation_mib_per_row


def imbalance_activation(layer: LayerTypeProfile, candidates: Sequence[Candidate], local: np.ndarray) -> np.ndarray:
    """Activation MiB the busiest rank keeps beyond an even routing, with ``local`` samples per rank, per
    candidate (ep 1 and checkpointed: none)."""
    experts = layer.experts
    out = np.zeros(len(candidates))
    if experts is None:
        return out
    per_row = experts.activation_mib_per_row + experts.dispatch_activation_mib_per_row
    for i, c in enumerate(candidates):
        if c.ep > 1 and not c.checkpoint and local[i] > 0:
            rows = local[i] * rows_per_sample(layer, c)
            out[i] = rows * (memory_imbalance(layer, c, local[i]) - 1.0) * per_row / c.cp
    return out
