"""The optimizer step's rate: milliseconds of one AdamW step per million parameters, every rank stepping at once.

The runtime steps AdamW (``foreach``) on fp32 master weights after the pipeline drains, on every rank together, so
the rate is timed the same way: fp32 parameters with gradients set, a barrier before each step, the median of the
repetitions, the slowest rank's. The tensors are a few layer-sized blocks (a rank's parameters are many tensors,
and ``foreach`` groups them), sized so that the step is long enough to time and short enough for ``--quick``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from galva_profiler.distributed import World, max_over_ranks
from galva_profiler.timing import Repeats, median_ms

BLOCKS = 8  # tensors stepped together


def measure_optimizer_rate(world: World, parameters: int, repeats: Repeats) -> float:
    """ms per million parameters of one AdamW step (collective; the same value on every rank)."""
    size = max(1, parameters // BLOCKS)
    params = [torch.nn.Parameter(torch.randn(size, device=world.device)) for _ in range(BLOCKS)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    ms = median_ms(optimizer.step, repeats, world.device, before=dist.barrier)
    return max_over_ranks(ms, world.device) / (size * BLOCKS / 1e6)
