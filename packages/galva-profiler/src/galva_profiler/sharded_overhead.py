"""What one layer under ZeRO-2 / ZeRO-3 costs beyond the plain layer: FSDP2's own work per call and the step.

galva-hp runs a ZeRO layer as an FSDP2 unit (:func:`galva_hp.data_parallel.wrap`). Around every forward FSDP2 copies
the shards into one buffer, all-gathers it and copies the gathered parameters out (ZeRO-3 again before the backward,
ZeRO-2 keeps them); after the backward it copies the gradients into a buffer, reduce-scatters it and copies the
shard out; its hooks run in Python per call. Every iteration AdamW then updates the layer's parameters, DTensor
shards, as galva-hp's optimizer does (on their local pieces, in a parameter group of their own). None of that is the
plain layer's ``F(b)``, and the collectives' curves of the hardware profile time the collectives alone: on
tiny-llama (hidden 64, 2 gloo ranks) the ZeRO-3 plan's step measured 2.2x the ddp plan's, of which the priced
gathers explained a fifth.

The backward is timed twice: with gradient sync on (the iteration's last micro-batch: the copy into the
reduce-scatter buffer and the shard's copy out) and off (every micro-batch before it: FSDP2 only accumulates the
unsharded gradients). Priced with the first on every micro-batch, a plan of several micro-batches paid the copies
each time, though galva-hp reduces once per iteration.

Timed on the model profiler's forked ranks (the group that times the tp forms, one per degree), as the tp forms'
overhead (:func:`galva_profiler.activation_memory.overhead_ms`): in the main thread's CPU time (the collectives run
in gloo's threads while this thread waits: priced apart), the unit on ``[b, s, h]`` per rank against the plain
layer on the same input, alternately, the fastest of the repetitions each. The step: galva-hp's own AdamW
(``GalvaOptimizer``'s, which steps a DTensor's local piece) on the unit's sharded parameters against the same on plain
tensors of the same local shapes, so that what remains is the sharded form's own cost, not the elements the
profile's optimizer terms already price. (It was ``torch.optim.AdamW`` on the DTensors, every per-tensor op
dispatched through DTensor, which galva-hp stopped doing: the profile priced tiny-llama's ZeRO-3 step at 3.3 ms a
layer on 2 ranks and 5.0 on 4, where the check measured the ZeRO-3 plan's clip + AdamW 3.6 and 6.5 ms above ddp's
for all 4 layers: the 4-rank ZeRO rows over-predicted by 41-42%.)
"""

from __future__ import annotations

import copy
import time
from functools import partial
from typing import Any

import torch
from torch import nn

from galva_profiler.layer_step import runtime_optimizer
from galva_profiler.layer_timing import FASTEST_OF, FORM_SAMPLES, cpu_passes, excess_ms, fastest_passes

SHARDED = ("zero2", "zero3")


def _step_cpu(optimizer: torch.optim.Optimizer) -> float:
    start = time.thread_time()
    optimizer.step()
    return time.thread_time() - start


def sharded_overhead_ms(
    plain: nn.Module, dp_type: str, group: Any, seq: int, hidden: int, dtype: torch.dtype
) -> tuple[float, float, float, float]:
    """(forward, backward, optimizer step, accumulating backward) ms a copy of ``plain`` wrapped as galva-hp's
    ``dp_type`` unit over ``group`` costs beyond ``plain`` on this rank's same work, each at least 0: the backward
    with gradient sync on (the iteration's last micro-batch), the accumulating one with it off (the micro-batches
    before). Collective: every rank of ``group`` calls it."""
    unit = sharded_unit("layer", plain, dp_type, group, dtype)

    def run(module: nn.Module, sync: bool | None) -> tuple[float, float]:
        if sync is not None:
            unit.before_backward(sync)
        module.zero_grad(set_to_none=True)
        return cpu_passes(module, FORM_SAMPLES, seq, hidden, dtype)

    # the plain layer, the unit accumulating, the unit reducing: reducing last, so the step below has its gradients
    base, accumulating, reducing = fastest_passes(
        [partial(run, plain, None), partial(run, unit.module, False), partial(run, unit.module, True)]
    )
    forward, backward = excess_ms(reducing, base)
    return forward, backward, step_overhead_ms(unit), excess_ms(accumulating, base)[1]


def sharded_unit(name: str, plain: nn.Module, dp_type: str, group: Any, dtype: torch.dtype) -> Any:
    """A copy of ``plain`` as galva-hp's ``dp_type`` unit over ``group``: fp32 shards computing in ``dtype`` (FSDP2's
    mixed-precision policy), as galva-hp holds it. Collective: every rank of ``group`` calls it."""
    from galva_hp.data_parallel import wrap
    from galva_hp.precision import PrecisionPolicy
    from galva_schema import DataParallelType

    policy = PrecisionPolicy() if dtype == torch.float32 else PrecisionPolicy(dtype, torch.float32)
    return wrap(name, copy.deepcopy(plain).float(), DataParallelType(dp_type), group, policy)


def step_overhead_ms(unit: Any) -> float:
    """ms galva-hp's AdamW on the sharded (DTensor) parameters of ``unit``, an FSDP2 unit whose gradients are
    reduced, costs beyond the same on plain tensors of the same local shapes, at least 0."""
    from galva_hp.data_parallel import local_tensor

    sharded = [p for _, p in unit.master_parameters()]
    shards = [nn.Parameter(local_tensor(p).detach().clone()) for p in sharded]
    for p, s in zip(sharded, shards):
        s.grad = local_tensor(p.grad).clone() if p.grad is not None else torch.zeros_like(s)
    optimizers = [runtime_optimizer(shards).optimizer, runtime_optimizer(sharded).optimizer]
    warmup, repeats = FASTEST_OF
    steps = [float("inf")] * 2
    for index in range(warmup + repeats):
        for k, optimizer in enumerate(optimizers):
            took = _step_cpu(optimizer)
            if index >= warmup:
                steps[k] = min(steps[k], took)
    return max(0.0, (steps[1] - steps[0]) * 1e3)
