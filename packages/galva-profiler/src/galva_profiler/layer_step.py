"""galva-hp's optimizer step over one module's own parameter tensors: ms per call, per module, per million elements.

The runtime's step after the pipeline drains is :class:`galva_hp.GalvaOptimizer`'s ``clip_grad_norm`` (a norm per
gradient, their sum, the clip's scaling) and ``step`` (AdamW), each looping over the rank's parameter tensors. On a
small model most of that is per-tensor work (on 2 gloo ranks of tiny-llama, 4-10 ms a step against 1-2 ms priced
from the hardware profile's rate per parameter, which is timed on a few large blocks). So the step is timed here on
the module's own tensors, through the runtime's own optimizer (whatever it does per tensor today), at full size and
with every tensor cut to ``1 / SHRINK`` of its elements: the two give the part that does not shrink when a rank
holds shards of the same tensors (tp, ZeRO) and the part per element; and twice the tensors (two modules' worth)
against once gives what a module adds apart from the call's own work, which a rank pays once, not per layer.

Each repetition times the three optimizers one after the other (a drift of a shared machine's load hits them alike);
the differences are medians of the differences repetition by repetition (a drift cancels within a pair), the call's
own work the fastest one-module step less the module's share. On CPU the clock is the calling thread's CPU time (the
step's work runs on it) with one intra-op thread (a layer's tensors are too small to split, and idle threads spinning
at a barrier made two threads' figures unreadable: one layer's share read 0.3 ms, then 16 ms); on a device, wall
time after a synchronize. The gradient norm's all-reduce of one number over the world is not in it (no process
group here) and not priced.

On CPU each timed step starts from cold caches (:data:`EVICT_MIB` touched first): the runtime's step follows a whole
forward and backward, which leave little of the optimizer's tensors in cache, where back-to-back steps find them
all there. On the 2-core box a whole tiny-llama's step read 1.6 ms back to back against 2.8 ms after 64 MiB were
touched in the same minute (32 MiB: the same within the box's noise), and 3.1 ms inside the check's training
steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from galva_profiler.distributed import synchronize
from galva_profiler.timing import Repeats

if TYPE_CHECKING:
    from galva_hp import GalvaOptimizer

SHRINK = 4  # the reduced point: every tensor at a quarter of its elements
EVICT_MIB = 32
"""MiB written before each timed step on CPU: a large server processor's last-level cache."""
MIN_REPETITIONS = 30  # a step of a layer is a millisecond or two: cheap to repeat


def cache_evictor(device: torch.device) -> Callable[[], None]:
    """A call that writes :data:`EVICT_MIB` on CPU, so that what runs next starts from cold caches; nothing on a
    device (the module's docstring)."""
    if device.type != "cpu":
        return lambda: None
    buffer = torch.zeros(EVICT_MIB * 2**20 // 4)

    def evict() -> None:
        buffer.add_(1.0)

    return evict


def _copies(module: nn.Module, shrink: int, device: torch.device) -> list[nn.Parameter]:
    """fp32 copies of ``module``'s parameter tensors (the masters the runtime steps), each with a gradient; with
    ``shrink`` > 1, the first ``1 / shrink`` of each one's elements, flattened."""
    out = []
    for p in module.parameters():
        own = p.detach().to(device=device, dtype=torch.float32)
        kept = own.reshape(-1)[: max(1, -(-own.numel() // shrink))] if shrink > 1 else own
        param = nn.Parameter(kept.clone())
        param.grad = torch.randn_like(param)
        out.append(param)
    return out


@dataclass(frozen=True)
class StepCost:
    """galva-hp's optimizer step, in ms: once per call (whatever a rank holds), per module, per million elements."""

    per_call_ms: float
    per_module_ms: float
    per_million_ms: float


def runtime_optimizer(params: list[nn.Parameter]) -> GalvaOptimizer:
    """galva-hp's :class:`~galva_hp.GalvaOptimizer` over ``params`` (AdamW on each parameter's local piece), as the
    runtime steps them: what the profile times the step by."""
    from galva_hp import GalvaOptimizer, OptimConfig
    from galva_hp.data_parallel import ParamRecord

    return GalvaOptimizer([ParamRecord(f"p{i}", p, 1) for i, p in enumerate(params)], OptimConfig(lr=1e-4))


def step_cost(module: nn.Module, repeats: Repeats, device: torch.device | None = None) -> StepCost:
    """galva-hp's clip and AdamW step over copies of ``module``'s parameter tensors (every figure at least 0; all 0
    for a module without parameters).

    Three optimizers alternate, repetition by repetition: one over the module's tensors, one over two copies of
    them, one over two copies cut to ``1 / SHRINK``: the second less the first is what one more module adds (its
    tensors and elements), the first less that is the call's own (the optimizer's and the scheduler's per-call
    work), and the second against the third splits the module's share into per-tensor and per-element work.
    """
    device = device or torch.device("cpu")
    sets = [
        _copies(module, 1, device),
        _copies(module, 1, device) + _copies(module, 1, device),
        _copies(module, SHRINK, device) + _copies(module, SHRINK, device),
    ]
    elements = [sum(p.numel() for p in params) for params in sets]
    if not elements[0]:
        return StepCost(0.0, 0.0, 0.0)
    optimizers = [runtime_optimizer(params) for params in sets]
    cpu = device.type == "cpu"
    clock = time.thread_time if cpu else time.perf_counter
    warmup = max(1, repeats.warmup)  # the first step creates AdamW's moments
    times: list[list[float]] = [[] for _ in sets]
    threads = torch.get_num_threads()
    evict = cache_evictor(device)
    if cpu:  # see the module's docstring
        torch.set_num_threads(1)
    try:
        for index in range(warmup + max(repeats.repetitions, MIN_REPETITIONS)):
            for k, optimizer in enumerate(optimizers):
                if index >= warmup:  # cold caches, as after a backward (module docstring)
                    evict()
                synchronize(device)
                start = clock()
                optimizer.clip_grad_norm()
                optimizer.step()
                synchronize(device)
                if index >= warmup:
                    times[k].append(clock() - start)
    finally:
        torch.set_num_threads(threads)
    one = min(times[0]) * 1e3
    module_ms = max(0.0, _paired_ms(times[1], times[0]))
    shrunk = elements[1] - elements[2]
    per_element = max(0.0, _paired_ms(times[1], times[2]) / shrunk) if shrunk > 0 else 0.0
    return StepCost(max(0.0, one - module_ms), max(0.0, module_ms - per_element * elements[0]), per_element * 1e6)


def _paired_ms(more: list[float], less: list[float]) -> float:
    """ms of the median of the differences, repetition by repetition (a drift cancels within a pair)."""
    return statistics.median(m - n for m, n in zip(more, less)) * 1e3
