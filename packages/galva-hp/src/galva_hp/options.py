"""Runtime choices of a build that are not part of the plan."""

from __future__ import annotations

from dataclasses import dataclass

from galva_comm.buckets import BUCKET_CAP_BYTES
from galva_hp.deferred_init import InitFn

__all__ = ["BuildOptions"]


@dataclass(frozen=True)
class BuildOptions:
    """Runtime choices that are not part of the plan.

    - ``seq_len``: the training sequence length, checked against every sequence-sharding degree at build time.
    - ``reduce_in_fp32``: reduce gradients in fp32 under bf16 (else in bf16).
    - ``reduce_every_micro_batch``: reduce gradients after every micro-batch backward instead of once per
      iteration (less memory for accumulated full gradients, more traffic).
    - ``init_fn``: initialiser for modules built on the meta device (see :mod:`galva_hp.deferred_init`).
    - ``measure_activations``: record the bytes autograd saves per layer (``HybridParallelModel.saved_bytes``).
    - ``device``: where this rank's modules, batches and communication buffers live (``"cpu"`` with gloo,
      ``"cuda:<local rank>"`` with NCCL).
    - ``bucket_cap_bytes``: ddp units of one group share a gradient all-reduce up to this many bytes
      (:data:`galva_comm.buckets.BUCKET_CAP_BYTES`, torch DDP's default; 0: one all-reduce per unit; the rule
      is :func:`galva_comm.buckets.gradient_buckets`, which galva-search prices by).
    """

    seq_len: int | None = None
    reduce_in_fp32: bool = True
    reduce_every_micro_batch: bool = False
    init_fn: InitFn | None = None
    measure_activations: bool = False
    device: str = "cpu"
    bucket_cap_bytes: int = BUCKET_CAP_BYTES
