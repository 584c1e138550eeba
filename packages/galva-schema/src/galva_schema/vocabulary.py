"""The one vocabulary of Galva, shared by every distribution.

Axes of parallelism (a *degree* is the size of the group along an axis):

- ``pp``: pipeline parallel. Stages are the outermost axis: stage ``s`` owns the contiguous rank block
  ``[s * W/pp, (s+1) * W/pp)``.
- ``tp``: tensor parallel (Megatron column/row split of one layer's weights).
- ``sp``: Ulysses sequence parallel (all-to-all of heads and sequence around attention). A layer uses either
  Megatron tp or Ulysses sp with the same degree field; ``megatron_sp`` is the separate Megatron
  sequence-parallel flag that shards activations along the sequence between tp layers.
- ``dp``: data parallel; ``zero`` is how a layer's data-parallel group shards states (see :class:`DataParallelType`).

Units appear in field names: ``_mib`` (2**20 bytes), ``_ms`` (milliseconds), ``_gb_per_s`` (1e9 bytes per second).
Layers are indexed from 0 in model order; "vocabulary layers" are the embedding, the final norm and the head.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

SCHEMA_VERSION = 1
"""Version written into every Galva file. Readers reject other versions with a clear message."""


class DataParallelType(str, Enum):
    """How a layer's data-parallel group holds parameters, gradients and optimizer states."""

    DDP = "ddp"  # everything replicated; gradients all-reduced
    ZERO2 = "zero2"  # gradients and optimizer states sharded; parameters replicated
    ZERO3 = "zero3"  # parameters, gradients and optimizer states sharded (FSDP full shard)


class PipelineSchedule(str, Enum):
    """Order of micro-batch forward/backward passes on each pipeline stage."""

    GPIPE = "gpipe"  # all forwards, then all backwards
    ONE_F_ONE_B = "1f1b"  # warm-up forwards, then alternate one forward / one backward (PipeDream-flush)
    # 1F1B over ``virtual_stages`` model chunks per rank (chunk c on stage c % pp): a smaller bubble, more p2p
    INTERLEAVED_1F1B = "interleaved-1f1b"
    # zero-bubble ZB-H1: backward split into input-gradient and weight-gradient passes, weight-gradient work
    # deferred into the bubble; 1F1B's activation memory in flight
    ZB_H1 = "zb-h1"


PIPELINE_TYPES: Mapping[str, PipelineSchedule] = {
    "gpipe": PipelineSchedule.GPIPE,
    "pipedream_flush": PipelineSchedule.ONE_F_ONE_B,
}
"""The reference's ``pipeline_type`` names and the schedules they mean: the only schedules it runs, and the names
every Galva command that speaks the reference's language accepts (:mod:`galva_schema.reference` re-exports it)."""


class Precision(str, Enum):
    """Compute precision of a run or of a profile."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def bytes_per_element(self) -> int:
        return 4 if self is Precision.FP32 else 2


class TimeModelForm(str, Enum):
    """How a forward-time profile depends on the workload (reference profile modes)."""

    STATIC = "static"  # one value at the profiled batch and sequence length
    BATCH = "batch"  # linear in the local batch size: time = slope * batch + intercept
    SEQUENCE = "sequence"  # quadratic in the sequence length, per sample


class GroupKind(str, Enum):
    """Kinds of rank group a layer (or the vocabulary layers of a stage) has; each kind partitions its stage.

    See :class:`galva_comm.layout.LayerGroups`, which holds one list of groups per kind.
    """

    TP = "tp"  # Megatron tensor-parallel group (singletons for Ulysses or tp = 1 layers)
    SP = "sp"  # Ulysses sequence-parallel group (singletons for Megatron layers)
    CP = "cp"  # context-parallel group: ranks holding different chunks of the same samples (ring attention)
    DP = "dp"  # ranks that see different samples with the same model shard
    SHARD = "shard"  # where gradients are reduced and ZeRO shards states: dp x cp, and x sp for Ulysses layers
    EP = "ep"  # expert-parallel group: ranks holding different experts (token dispatch and combine)
    ETP = "etp"  # expert tensor-parallel group: ranks holding different parts of the same experts
    EDP = "edp"  # expert data-parallel group: ranks holding the same expert shard (its gradients are reduced there)
    WHOLE = "whole"  # every rank of the stage (a micro-batch's router statistics are summed over it)


# ------------------------------------------------------------------------------------------------- module names
# A model is Galva's ordered modules: the embedding, its layers, the head. Checkpoints, data-parallel units, plans
# and profiles name them so; every package asks these instead of spelling the names.
EMBEDDING_MODULE = "embedding"
HEAD_MODULE = "head"


def layer_module(index: int) -> str:
    """The name of layer ``index`` (``layers.3``)."""
    return f"layers.{index}"


def layer_of_module(name: str) -> int | None:
    """The layer index a module name (``layers.3``, or a parameter name under it) names; None for the embedding,
    the head or another name."""
    head, _, rest = name.partition(".")
    index = rest.partition(".")[0]
    return int(index) if head == "layers" and index.isdigit() else None
