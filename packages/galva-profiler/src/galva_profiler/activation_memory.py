"""Activation bytes a module keeps for backward, measured with saved-tensor hooks (exact on CPU).

galva-hp's :func:`~galva_hp.hooks.saved_activation_meter` counts every distinct storage autograd saves during a
forward pass, parameters and views of parameters (``nn.Linear``'s ``weight.t()``) excluded: the same meter the runtime
uses (``BuildOptions(measure_activations=True)``), so ``galva-profile check`` compares like with like. A layer is
measured at batch 2 and 3; the difference is the bytes *per sample* (what the cost model multiplies by the local
batch), the rest is a per-call constant (e.g. rotary cos/sin tables): the plain layer's is the profile's
``activation_mib_per_call``, every form's is in the report.

Per tensor-parallel degree ``t`` the layer's parallel form is built by the adapter's parallelizer in a real gloo
group of ``t`` forked ranks (:func:`galva_comm.testing.run_distributed`) and measured on each rank: Megatron tp
(input ``[b, s, h]``), Megatron-SP and Ulysses (input ``[b, s/t, h]``), and each of them checkpointed (galva-hp's
``Checkpointed``: only the input is kept). The largest rank's bytes are kept. Forking shares the materialised layer
with the children, so nothing is built twice.

The same ranks also time what a parallel form costs beyond the plain layer at its share of the work
(:func:`overhead_ms`): the parallel form on ``[2t, s, h]`` (Megatron tp) or ``[2t, s/t, h]`` (Megatron-SP, Ulysses)
against the plain layer on ``[2, s, h]``, the same work per rank, in the main thread's CPU time less the CPU spent
inside torch.distributed's calls (:func:`galva_profiler.layer_timing.cpu_passes`), so that waiting for the other
ranks and their collectives (priced apart, from the hardware profile's curves, a call's own CPU included) is left
out and outside load moves it little. The cost model adds it to the layer's compute: tp's extra Python, copies and
splits per call, which the plain layer's ``F(b/t)`` does not have (+28% of a tp-2 layer's compute for galva run's
default model).
At each degree they time the layer under ZeRO-2 and ZeRO-3 the same way (:mod:`galva_profiler.sharded_overhead`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from galva_profiler.layer_timing import FORM_SAMPLES, cpu_passes, excess_ms, fastest_passes

MODES = ("tp", "megatron_sp", "ulysses")


def saved_bytes(run: Callable[[], Any]) -> int:
    """Bytes autograd saves while ``run()`` executes (distinct storages, parameters excluded)."""
    from galva_hp.hooks import saved_activation_meter

    with saved_activation_meter() as meter:
        out = run()
    del out
    return meter.bytes


def per_sample(run_at: Callable[[int], Any]) -> tuple[int, int]:
    """``(bytes per sample, constant bytes)`` from measurements at batch 2 and 3: a batch of one may save a view
    where larger batches save a copy (T5's decoder rows of the stream are contiguous for one sample only: batches 1
    and 2 read 11% more per sample than any two larger ones); every other family is linear from batch 1 on."""
    two, three = saved_bytes(lambda: run_at(2)), saved_bytes(lambda: run_at(3))
    return three - two, 3 * two - 2 * three


@dataclass
class LayerActivations:
    """Per-sample activation bytes of one layer type at one sequence length, per mode and degree."""

    bytes_per_sample: dict[str, dict[int, int]] = field(default_factory=dict)  # mode -> degree -> bytes
    checkpoint_bytes_per_sample: dict[str, dict[int, int]] = field(default_factory=dict)
    constant_bytes: dict[str, dict[int, int]] = field(default_factory=dict)
    overhead_ms: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)  # (forward, backward)
    # dp type (zero2, zero3) -> sharding degree -> (forward, backward, optimizer step) ms beyond the plain layer
    sharded_overhead_ms: dict[str, dict[int, tuple[float, float, float]]] = field(default_factory=dict)
    # dp type -> sharding degree -> backward ms beyond the plain layer with gradient sync off (accumulating)
    sharded_accumulate_ms: dict[str, dict[int, float]] = field(default_factory=dict)

    def add(self, mode: str, degree: int, kept: tuple[int, int], checkpointed: tuple[int, int]) -> None:
        self.bytes_per_sample.setdefault(mode, {})[degree] = kept[0]
        self.constant_bytes.setdefault(mode, {})[degree] = kept[1]
        self.checkpoint_bytes_per_sample.setdefault(mode, {})[degree] = checkpointed[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes_per_sample": self.bytes_per_sample,
            "checkpoint_bytes_per_sample": self.checkpoint_bytes_per_sample,
            "constant_bytes": self.constant_bytes,
            "overhead_ms": self.overhead_ms,
            "sharded_overhead_ms": self.sharded_overhead_ms,
            "sharded_accumulate_ms": self.sharded_accumulate_ms,
        }


def _measure(module: nn.Module, seq: int, hidden: int, dtype: torch.dtype) -> tuple[tuple[int, int], tuple[int, int]]:
    """(kept, checkpointed) per-sample measurements of ``module`` on ``[b, seq, hidden]`` inputs."""
    from galva_hp.activation_checkpoint import Checkpointed

    def call(target: nn.Module) -> Callable[[int], Tensor]:
        return lambda b: target(torch.randn(b, seq, hidden, dtype=dtype, requires_grad=True))

    return per_sample(call(module)), per_sample(call(Checkpointed(module)))


def overhead_ms(
    plain: nn.Module, parallel: nn.Module, mode: str, degree: int, seq: int, hidden: int, dtype: torch.dtype
) -> tuple[float, float]:
    """(forward, backward) ms one call of ``parallel`` (this rank's form at ``degree``) costs beyond ``plain`` on
    this rank's share of the same work, at least 0.

    The two alternate repetition by repetition and each keeps its fastest (outside load only adds time), in the main
    thread's CPU time (a rank waiting for its group's collective spends none)."""
    samples = FORM_SAMPLES * degree
    # Megatron tp: the form sees the whole sequence of all its samples; a sequence split: [b, s/t, h] per rank
    parallel_seq = seq if mode == "tp" else seq // degree

    def run(module: nn.Module, batch: int, seq: int) -> tuple[float, float]:
        module.zero_grad(set_to_none=True)
        return cpu_passes(module, batch, seq, hidden, dtype)

    base, form = fastest_passes([partial(run, plain, FORM_SAMPLES, seq), partial(run, parallel, samples, parallel_seq)])
    return excess_ms(form, base)


def _rank_worker(
    rank: int, world_size: int, module: nn.Module, layer_type: str, parallelizer: Any, modes: list[str], seq: int,
    hidden: int, dtype: torch.dtype,
) -> tuple[dict[str, Any], dict[str, tuple[float, float, float, float]]]:  # fmt: skip
    """Every mode at this degree, on one rank of a ``world_size``-rank gloo group: activations and overhead; then
    the overhead of ZeRO-2 and ZeRO-3 over the same group."""
    import torch.distributed as dist

    from galva_hp.model import ParallelContext
    from galva_profiler.sharded_overhead import SHARDED, sharded_overhead_ms

    group = dist.group.WORLD
    out = {}
    for mode in modes:
        if mode == "ulysses":
            ctx = ParallelContext(sp_group=group)
        else:
            ctx = ParallelContext(tp_group=group, megatron_sp=mode == "megatron_sp")
        local_seq = seq if mode == "tp" else seq // world_size
        parallel = parallelizer.layer(copy.deepcopy(module), layer_type, ctx)  # forms may be applied in place, once
        kept, checkpointed = _measure(parallel, local_seq, hidden, dtype)
        out[mode] = (kept, checkpointed, overhead_ms(module, parallel, mode, world_size, seq, hidden, dtype))
    sharded = {dp: sharded_overhead_ms(module, dp, group, seq, hidden, dtype) for dp in SHARDED}
    return out, sharded


def preload_parallel_forms() -> None:
    """Import galva-hp's parallel building blocks once in this process, so forked ranks do not each import them."""
    import importlib

    for name in ("tensor_parallel", "ulysses", "vocab"):
        with contextlib.suppress(ImportError):
            importlib.import_module(f"galva_hp.parallel.{name}")


def measure_layer(
    module: nn.Module,
    layer_type: str,
    parallelizer: Any,
    seq: int,
    hidden: int,
    dtype: torch.dtype,
    degrees: dict[str, list[int]],
    timeout_s: float = 300.0,
) -> LayerActivations:
    """Activations of ``module`` at degree 1 and, per mode, at each degree in ``degrees[mode]`` (forked ranks)."""
    from galva_comm.testing import run_distributed

    preload_parallel_forms()
    result = LayerActivations()
    kept, checkpointed = _measure(module, seq, hidden, dtype)
    for mode in MODES:
        result.add(mode, 1, kept, checkpointed)
    for degree in sorted({d for mode in MODES for d in degrees.get(mode, []) if d > 1}):
        modes = [mode for mode in MODES if degree in degrees.get(mode, [])]
        ranks = run_distributed(
            _rank_worker, degree, module, layer_type, parallelizer, modes, seq, hidden, dtype, timeout=timeout_s
        )
        forms = [r[0] for r in ranks]
        for mode in modes:
            worst = max((r[mode] for r in forms), key=lambda m: m[0][0])  # ranks may differ: keep the largest
            result.add(mode, degree, worst[0], worst[1])
            # the group moves at its slowest rank's pace: the largest overhead of each pass
            result.overhead_ms.setdefault(mode, {})[degree] = (
                max(r[mode][2][0] for r in forms),
                max(r[mode][2][1] for r in forms),
            )
        for dp_type in ranks[0][1]:  # the same: the largest of each part over the ranks
            f, b, step, accumulating = (max(part) for part in zip(*(r[1][dp_type] for r in ranks)))
            result.sharded_overhead_ms.setdefault(dp_type, {})[degree] = (f, b, step)
            result.sharded_accumulate_ms.setdefault(dp_type, {})[degree] = accumulating
    return result
