"""A reference loop that ties the model profile's layer times to the hardware profile's minute.

On a shared machine a process's speed moves from minute to minute: one quiet quarter hour's model profiles read
tiny-llama's forward intercept at 1.96 to 3.4 ms, and every prediction priced on one of them moved with it. The
model profile and the hardware profile are measured minutes apart, and the job's compute is priced from both (the
layer alone, times the hardware profile's every-rank-at-once slowdown). Each profile therefore also times one fixed
matmul (:data:`REFERENCE_MATMUL`, fp32): the model profile between its layer passes, the hardware profile on one
rank alone between its concurrency rounds, both by the layers' clock
(:func:`galva_profiler.layer_timing.pass_clock`). galva-search scales the layer times by the ratio of the two (the
profile's ``compute_reference_ms``): a layer timed in a slow minute is priced as if timed in the hardware profile's.

In one process on the 2-core box, 6-second means of a tiny-llama layer's passes read 29.6-39.1 ms over a minute
while their ratio to a matmul loop interleaved with them read 3.55-4.04.
"""

from __future__ import annotations

import statistics

import torch

from galva_profiler.distributed import synchronize
from galva_profiler.layer_timing import pass_clock

REFERENCE_MATMUL = 256
"""Side of the square fp32 matrices the reference multiplies."""
REFERENCE_CALLS = 2
"""Timed multiplications per sample (after one untimed one: the operands in cache, as in a loop)."""


class ReferenceClock:
    """Samples of the reference matmul's ms per call on ``device``, by the layers' clock; :meth:`sample` one more,
    :meth:`median_ms` their median (None before any)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        generator = torch.Generator().manual_seed(0)
        shape = (REFERENCE_MATMUL, REFERENCE_MATMUL)
        self._a = torch.randn(shape, generator=generator).to(device)
        self._b = torch.randn(shape, generator=generator).to(device)
        self.samples: list[float] = []

    def sample(self) -> float:
        """Time one sample now (ms per matmul) and keep it."""
        clock = pass_clock(self.device)
        torch.mm(self._a, self._b)
        synchronize(self.device)
        start = clock()
        for _ in range(REFERENCE_CALLS):
            torch.mm(self._a, self._b)
        synchronize(self.device)
        ms = (clock() - start) * 1e3 / REFERENCE_CALLS
        self.samples.append(ms)
        return ms

    def median_ms(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None
