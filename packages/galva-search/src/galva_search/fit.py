"""When no plan fits: what would. The largest global batch that fits the budget, and the smallest budget that fits
the batch asked, each found by running the search again (bounded in runs and seconds).

Both searches assume that memory grows with the batch and that a larger budget never removes a plan, which holds
for the cost model (every term is non-decreasing in the batch; the budget only prunes). Batch sizes are tried among
``b // d`` for integer ``d``, which keeps the runs logarithmic and includes every power-of-two fraction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from galva_search.options import GIB, SearchOptions

__all__ = ["what_would_fit"]

MAX_BUDGET_FACTOR = 256.0
"""Budgets are tried up to this multiple of the one asked; past it the space, not the budget, is the problem."""
BUDGET_PRECISION = 0.02
"""The smallest fitting budget is reported within this fraction (rounded up)."""
TIME_LIMIT_S = 20.0
"""Seconds of extra searching at most; past them the bounds found so far are reported."""


def what_would_fit(fits: Callable[[SearchOptions], bool], options: SearchOptions) -> str:
    """One clause for the infeasible message: e.g. ``global batch size 12 fits this budget; batch size 16 fits a
    budget of 2300 MiB (2.25 GiB)``. ``fits(options)`` runs the search and says whether a plan was found."""
    deadline = time.monotonic() + TIME_LIMIT_S
    asked = min(options.batch_sizes)
    clauses = []
    batch = _largest_batch(fits, options, asked, deadline)
    if batch is not None:
        clauses.append(f"global batch size {batch} fits this budget")
    budget = _smallest_budget(fits, options, asked, deadline)
    if budget is None:
        clauses.append(
            f"batch size {asked} fits no budget up to {MAX_BUDGET_FACTOR:.0f}x this one: widen the search space "
            "(more tp, pipelines, ZeRO-3, checkpointing)"
        )
    else:
        clauses.append(f"batch size {asked} fits a budget of {budget:.0f} MiB ({budget / GIB:.2f} GiB)")
    return "; ".join(clauses)


def _largest_batch(
    fits: Callable[[SearchOptions], bool], options: SearchOptions, asked: int, deadline: float
) -> int | None:
    sizes = sorted({asked // d for d in range(2, asked + 1)} - {0})
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi and time.monotonic() < deadline:
        mid = (lo + hi) // 2
        if fits(replace(options, batch_sizes=(sizes[mid],))):
            best, lo = sizes[mid], mid + 1
        else:
            hi = mid - 1
    return best


def _smallest_budget(
    fits: Callable[[SearchOptions], bool], options: SearchOptions, asked: int, deadline: float
) -> float | None:
    def fits_at(budget: float) -> bool:
        return fits(replace(options, memory_budget_mib=budget, batch_sizes=(asked,)))

    low, high = options.memory_budget_mib, options.memory_budget_mib * 2
    while not fits_at(high):
        if high >= options.memory_budget_mib * MAX_BUDGET_FACTOR or time.monotonic() > deadline:
            return None
        low, high = high, high * 2
    while high - low > BUDGET_PRECISION * high and time.monotonic() < deadline:
        mid = (low + high) / 2
        if fits_at(mid):
            high = mid
        else:
            low = mid
    return high
