"""Training data for galva-train: random tokens, Megatron indexed datasets, and the global-batch loader contract.

Contract (what the runtime relies on): a :class:`~galva_models.data.loader.GlobalBatchSource` returns, for a step,
the *same global batch on every rank* (``inputs`` and ``labels``, batch first). It depends only on the source's
seed, the step and the global batch shape, never on the parallel plan. The runtime (galva-hp) slices each rank's
share with :func:`~galva_models.data.loader.dp_share`: data-parallel rank ``r`` of ``d`` takes the contiguous rows
``[r * B/d, (r+1) * B/d)``, then micro-batch ``m`` of ``M`` takes contiguous rows of that share.
"""

from galva_models.data.indexed import IndexedTokenSource, TokenWindows
from galva_models.data.loader import Batch, GlobalBatchSource, dp_share, micro_batches
from galva_models.data.random import (
    RandomImageSource,
    RandomMaskedTokenSource,
    RandomSeq2SeqSource,
    RandomTokenSource,
    random_source,
    step_generator,
)

__all__ = [
    "Batch",
    "GlobalBatchSource",
    "IndexedTokenSource",
    "RandomImageSource",
    "RandomMaskedTokenSource",
    "RandomSeq2SeqSource",
    "RandomTokenSource",
    "TokenWindows",
    "dp_share",
    "micro_batches",
    "random_source",
    "step_generator",
]
