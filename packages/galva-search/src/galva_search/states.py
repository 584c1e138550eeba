"""Model-state accounting: bytes of parameters, gradients and optimizer states per parameter, and the share of them
one rank holds under each data-parallel type (docs/cost-model.md §4)."""

from __future__ import annotations

import numpy as np

from galva_schema import DataParallelType, Precision

ZERO2 = DataParallelType.ZERO2
ZERO3 = DataParallelType.ZERO3
STATE_ACCOUNTINGS = ("reference", "galva-hp")
"""Values of :attr:`galva_search.cost_settings.CostSettings.state_accounting`."""
# (compute parameter, gradient, master + Adam) bytes per parameter under ddp, by (accounting, fp32)
_STATE_BYTES = {
    ("reference", False): (2, 2, 12),  # bf16 parameter and gradient, fp32 master + Adam m, v
    ("reference", True): (4, 4, 8),
    ("galva-hp", False): (2, 4, 12),  # galva-hp keeps the gradient in fp32 (master gradient / FSDP2 reduce dtype)
    ("galva-hp", True): (4, 4, 8),
}


def state_bytes(precision: Precision, accounting: str = "galva-hp") -> tuple[int, int, int]:
    """Bytes per parameter of (compute parameters, gradients, optimizer states incl. fp32 master weights) held under
    ddp with AdamW.

    fp32: 4 + 4 + (4 + 4) = 16. bf16 as galva-hp holds it: 2 + 4 + (4 master + 4 + 4) = 18: the gradient a rank
    keeps is fp32 (ddp units reduce into the fp32 master's gradient, FSDP2 accumulates and reduce-scatters in its fp32
    ``reduce_dtype``), as Megatron-LM's 18 bytes; the reference's accounting counts 2 + 2 + 12 = 16.
    """
    if accounting not in STATE_ACCOUNTINGS:
        raise ValueError(f"state accounting {accounting!r} is not one of {', '.join(STATE_ACCOUNTINGS)}")
    return _STATE_BYTES[accounting, precision is Precision.FP32]


def state_bytes_per_parameter(precision: Precision, accounting: str = "galva-hp") -> int:
    """Model-state bytes per unsharded parameter (ddp) with AdamW: 16, or 18 for galva-hp in bf16 (docs §4).

    The profiler writes the vocabulary layers' ``model_states_mib`` as galva-hp holds them at its precision.
    """
    return sum(state_bytes(precision, accounting))


def state_fraction(
    dp_type: DataParallelType,
    shard: np.ndarray | int,
    accumulating: bool,
    *,
    precision: Precision,
    accounting: str = "galva-hp",
) -> np.ndarray:
    """Share of the unsharded (ddp) model-state bytes one rank holds under ``dp_type`` over ``shard`` ranks.

    ``accounting`` "reference" keeps the reference's formulas (below in the code). "galva-hp" is what galva-hp holds
    at its peak (``galva-profile check`` measures it; docs/cost-model.md §4), with ``(p, q, o)`` =
    :func:`state_bytes` and ``d`` = ``shard``:

    * ddp, or any type over one rank (galva-hp wraps a one-rank group as ddp): ``p + q + o``;
    * ZeRO-2: the gathered compute copy ``p`` stays until the layer's backward is done and master weights and
      Adam states are sharded, ``o/d``; gradients accumulated over several micro-batches are a full-size buffer
      ``q``; with one micro-batch the gradient shard appears as the gathered copy goes, so the peak holds
      ``max(p, q/d)`` of the two. In fp32 the parameter shard is kept beside the gathered copy (``p/d`` more,
      the gathered copy is no master); in bf16 that shard is the master, inside ``o``;
    * ZeRO-3: parameters at rest are the shards (fp32: ``p/d``; bf16: the master, in ``o/d``; the gathered
      compute copy is a transient, ``gather_mib``), gradients ``q/d``, or ``q`` while accumulating.
    """
    p_b, g_b, o_b = state_bytes(precision, accounting)
    fp32 = precision is Precision.FP32
    d = np.asarray(shard, dtype=float)
    inv = 1.0 / d
    if accounting == "reference":
        # p sharded by ZeRO-3 only, o by ZeRO-2/3, q by ZeRO-2/3 unless accumulating (a full-size buffer, the
        # reference's async_grad_reduce); fp32 ZeRO-2 accumulating keeps the parameter shard too (p/d more)
        zero = dp_type in (ZERO2, ZERO3)
        p = inv if dp_type is ZERO3 else (1.0 + inv if dp_type is ZERO2 and accumulating and fp32 else 1.0)
        g = inv if zero and not accumulating else 1.0
        o = inv if zero else 1.0
        return np.asarray((p_b * p + g_b * g + o_b * o) / (p_b + g_b + o_b))
    if dp_type is ZERO2 and accumulating:
        held = p_b * (1.0 + inv if fp32 else 1.0) + g_b
    elif dp_type is ZERO2:  # fp32: p + q/d (the shard counted once); bf16: max(p, q/d), p for d >= 2
        held = p_b + g_b * inv if fp32 else np.maximum(p_b, g_b * inv)
    elif dp_type is ZERO3:
        held = (p_b * inv if fp32 else 0.0 * d) + (g_b if accumulating else g_b * inv)
    else:
        held = (p_b + g_b) * np.ones_like(d)
    held = held + (o_b * inv if dp_type in (ZERO2, ZERO3) else o_b)
    total = p_b + g_b + o_b
    return np.asarray(np.where(d <= 1.0, 1.0, held / total))
