"""Forward and backward time of one module at one batch size and sequence length (warm-up, repetitions, median)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from galva_profiler.distributed import synchronize
from galva_profiler.timing import Repeats


@dataclass(frozen=True)
class PassTimes:
    """Median forward and backward ms of one module call."""

    forward_ms: float
    backward_ms: float


def time_passes(forward: Callable[[], Tensor], repeats: Repeats, device: torch.device | None = None) -> PassTimes:
    """Time ``forward()`` and the backward of its (scalar-reduced) output, each repetition timed on its own.

    The backward is seeded with ones of the output's shape, so its cost is the module's backward alone (no loss).
    """
    device = device or torch.device("cpu")
    forwards, backwards = [], []
    for index in range(repeats.warmup + repeats.repetitions):
        synchronize(device)
        start = time.perf_counter()
        out = forward()
        synchronize(device)
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        synchronize(device)
        end = time.perf_counter()
        if index >= repeats.warmup:
            forwards.append((middle - start) * 1e3)
            backwards.append((end - middle) * 1e3)
    return PassTimes(statistics.median(forwards), statistics.median(backwards))


def layer_forward(
    module: torch.nn.Module, batch: int, seq: int, hidden: int, dtype: torch.dtype
) -> Callable[[], Tensor]:
    """A forward of a transformer layer on a fresh ``[batch, seq, hidden]`` input that requires grad (as in a model)."""
    x = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True)

    def run() -> Tensor:
        module.zero_grad(set_to_none=True)
        x.grad = None
        return module(x)

    return run
