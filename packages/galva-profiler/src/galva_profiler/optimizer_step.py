"""The optimizer step's rate: milliseconds of one AdamW step per million parameters, every rank stepping at once.

The runtime steps AdamW (``foreach``) on fp32 master weights after the pipeline drains, on every rank together, so
the rate is timed the same way: fp32 parameters with gradients set, every rank stepping at once from a barrier to
the last rank's end (:func:`galva_profiler.timing.span_ms`), the median of at least ``rounds`` steps (3 steps, each
rank timed from its own start, read 30.0 and 15.7 ms per million parameters in two quickstarts of one quiet hour).
The tensors are a few layer-sized blocks (a rank's parameters are many tensors, and ``foreach`` groups them), sized
so that the step is long enough to time and short enough for ``--quick``.
"""

from __future__ import annotations

import statistics

import torch

from galva_profiler.concurrency import MIN_ROUNDS
from galva_profiler.distributed import World
from galva_profiler.timing import Repeats, together_ms

BLOCKS = 8  # tensors stepped together


def measure_optimizer_rate(world: World, parameters: int, repeats: Repeats, rounds: int = MIN_ROUNDS) -> float:
    """ms per million parameters of one AdamW step (collective; the same value on every rank)."""
    size = max(1, parameters // BLOCKS)
    params = [torch.nn.Parameter(torch.randn(size, device=world.device)) for _ in range(BLOCKS)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    for _ in range(max(1, repeats.warmup)):  # the first step creates the moments
        together_ms(optimizer.step, world)
    steps = [together_ms(optimizer.step, world) for _ in range(max(repeats.repetitions, rounds))]
    return statistics.median(steps) / (size * BLOCKS / 1e6)
