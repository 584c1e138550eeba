"""Parallel-form helpers of the family that still has an adapter class (T5), built from galva-hp's building blocks
(:mod:`galva_hp.parallel`). Every form is built from *copies* of the single-process weights (this rank's shards), so
it computes the same function; the single-process module is left untouched. (The families run from tables are
parallelized in place instead: :mod:`galva_models.tables`.)
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from galva_hp.model import ParallelContext


def tp_group(ctx: ParallelContext) -> ProcessGroup:
    """The tensor-parallel group of a context that has one (tp > 1)."""
    if ctx.tp_group is None:
        raise ValueError("this parallel form needs a tensor-parallel group (tp > 1)")
    return ctx.tp_group
