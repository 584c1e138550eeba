"""Global mode: one plan for every layer from a handful of flags (the reference system's run without a strategy file).

The flags mirror the reference runtime's (``--pp_deg``, ``--global_tp_deg``, ``--global_tp_consec``, ``--sdp``,
``--default_dp_type``, ``--chunks``, ``--global_checkpoint``, ``--pipeline_type``, ``--vocab_tp``, ``--vocab_sp``,
``--use-ulysses``, ``--sequence-parallel``, ``--mixed_precision``). Differences, on purpose: ``tp_consecutive=False``
is honoured (the reference silently forced consecutive groups), ``chunks`` must be given (no hidden auto rule), and
the result is a validated :class:`~galva_schema.Strategy`, so a bad combination fails here with the field named.
"""

from __future__ import annotations

from dataclasses import dataclass

from galva_schema import DataParallelType, PipelineSchedule, Precision, Strategy

__all__ = ["GlobalFlags", "strategy_from_flags"]

_PIPELINE_TYPES = {
    "gpipe": PipelineSchedule.GPIPE,
    "pipedream_flush": PipelineSchedule.ONE_F_ONE_B,
    "1f1b": PipelineSchedule.ONE_F_ONE_B,
    "interleaved-1f1b": PipelineSchedule.INTERLEAVED_1F1B,
    "zb-h1": PipelineSchedule.ZB_H1,
}


@dataclass(frozen=True)
class GlobalFlags:
    """The global-mode flags (reference names in comments)."""

    world_size: int
    num_layers: int
    global_batch_size: int  # --global_train_batch_size
    pp: int = 1  # --pp_deg
    tp: int = 1  # --global_tp_deg
    tp_consecutive: bool = True  # --global_tp_consec
    ulysses: bool = False  # --use-ulysses: tp is the Ulysses degree
    megatron_sp: bool = False  # --sequence-parallel
    sdp: bool = False  # --sdp: ZeRO-3 on every layer (overrides default_dp_type)
    default_dp_type: str = "ddp"  # --default_dp_type: ddp | zero2 | zero3
    chunks: int = 1  # --chunks: micro-batches per iteration
    checkpoint: bool = False  # --global_checkpoint
    pipeline_type: str = "gpipe"  # --pipeline_type: gpipe | pipedream_flush (1f1b); Galva's interleaved-1f1b, zb-h1
    virtual_stages: int = 1  # Galva's (Megatron's --num-virtual-stages-per-pipeline-rank): chunks per stage
    vocab_tp: int = 1  # --vocab_tp
    vocab_sp: bool = False  # --vocab_sp
    embed_sdp: bool = False  # --embed_sdp: ZeRO-3 on the vocabulary layers
    mixed_precision: str = "bf16"  # --mixed_precision: fp32 | bf16
    cp: int = 1  # Megatron's --context-parallel-size: every layer and the vocabulary layers
    ep: int = 1  # Megatron's --expert-model-parallel-size: experts split over ep ranks
    etp: int = 1  # Megatron's --expert-tensor-parallel-size: each expert's FFN split over etp ranks
    expert_dp_type: str | None = None  # the experts' replicas: ddp | zero2 | zero3 (None: the layer's)


def strategy_from_flags(flags: GlobalFlags) -> Strategy:
    """The uniform :class:`~galva_schema.Strategy` the flags describe (raises SchemaError/ValueError if invalid)."""
    if flags.pipeline_type not in _PIPELINE_TYPES:
        raise ValueError(f"pipeline_type: {flags.pipeline_type!r} is not one of {sorted(_PIPELINE_TYPES)}")
    dp_type = DataParallelType.ZERO3 if flags.sdp else DataParallelType(flags.default_dp_type)
    return Strategy.uniform(
        world_size=flags.world_size,
        num_layers=flags.num_layers,
        global_batch_size=flags.global_batch_size,
        layer={
            "tp": flags.tp,
            "tp_consecutive": flags.tp_consecutive,
            "ulysses": flags.ulysses,
            "cp": flags.cp,
            "checkpoint": flags.checkpoint,
            "ep": flags.ep,
            "etp": flags.etp,
            "expert_dp_type": flags.expert_dp_type,
        },
        pp=flags.pp,
        pipeline_schedule=_PIPELINE_TYPES[flags.pipeline_type],
        virtual_stages=flags.virtual_stages,
        num_micro_batches=flags.chunks,
        mixed_precision=Precision(flags.mixed_precision),
        default_dp_type=dp_type,
        megatron_sp=flags.megatron_sp,
        vocab={
            "tp": flags.vocab_tp,
            "sp": flags.vocab_sp,
            "cp": flags.cp,
            "dp_type": DataParallelType.ZERO3 if flags.embed_sdp else None,
        },
        description="global mode",
    )
