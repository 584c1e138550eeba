"""Megatron tensor parallelism (and Megatron-SP) built from megatron-core layers with an explicit ``tp_group``.

Every block is made *from the single-process weights*: it copies this rank's shard, so a converted model computes
the same function as the original. One module per job, all re-exported here:

- :mod:`.tp_regions`: entering and leaving a tp region (plain tp or Megatron-SP), column/row-parallel linears,
  sharding and the parameter tags;
- :mod:`.sp_norms`: norms whose replicated parameters are applied to a sequence shard (gradient summed over tp);
- :mod:`.tp_attention`: ``TensorParallelAttention`` (GQA, rotary, causal or not);
- :mod:`.tp_mlp`: ``TensorParallelMLP``;
- :mod:`.gather_state`: ``gather_full_state`` / ``param_or_grad``, the single-process state of a parallel form.
"""

from __future__ import annotations

from galva_hp.parallel.gather_state import gather_full_state, param_or_grad
from galva_hp.parallel.sp_norms import SequenceParallelLayerNorm, SequenceParallelRMSNorm, sequence_parallel_norm
from galva_hp.parallel.tp_attention import TensorParallelAttention
from galva_hp.parallel.tp_mlp import TensorParallelMLP
from galva_hp.parallel.tp_regions import (
    SEQ_DIM,
    column_parallel_linear,
    enter_tp_region,
    exit_tp_region,
    mark_sequence_parallel,
    mark_tp_split,
    megatron_config,
    row_parallel_linear,
    shard,
)

__all__ = [
    "SEQ_DIM",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
    "TensorParallelAttention",
    "TensorParallelMLP",
    "column_parallel_linear",
    "enter_tp_region",
    "exit_tp_region",
    "gather_full_state",
    "mark_sequence_parallel",
    "mark_tp_split",
    "megatron_config",
    "param_or_grad",
    "row_parallel_linear",
    "sequence_parallel_norm",
    "shard",
]
