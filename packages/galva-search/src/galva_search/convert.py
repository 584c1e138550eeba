"""Between the search's candidates and :class:`galva_schema.Strategy`, both ways."""

from __future__ import annotations

from collections.abc import Sequence

from galva_comm.layout import ranks_per_stage, tp_consecutive
from galva_schema import DataParallelType, LayerStrategy, Strategy, VocabStrategy
from galva_search.cost_model import CostSettings
from galva_search.space import Candidate
from galva_search.tasks import Task


def to_strategy(
    settings: CostSettings,
    world_size: int,
    model_name: str,
    task: Task,
    choices: Sequence[Sequence[int]],
    iteration_time_s: float,
) -> Strategy:
    """The plan of a solved task (``choices[s]``: candidate index of every layer of stage ``s``, its model chunks in
    model order), validated. The schedule and model chunks per stage are the task's."""
    layers = []
    stage_ranks = ranks_per_stage(world_size, task.pp)
    for cand in model_order(task, choices):
        layers.append(
            LayerStrategy(
                tp=cand.tp,
                tp_consecutive=tp_consecutive(cand.tp, stage_ranks, cand.consecutive),
                ulysses=cand.ulysses,
                dp_type=None if cand.dp_type is settings.default_dp_type else cand.dp_type,
                checkpoint=cand.checkpoint,
                ep=cand.ep,
                etp=cand.etp,
                expert_dp_type=cand.expert_dp_type,
                cp=cand.cp,
            )
        )
    zero3 = DataParallelType.ZERO3
    vocab = VocabStrategy(
        tp=task.vocab.tp,
        sp=task.vocab.sp,
        dp_type=zero3 if task.vocab.zero3 and settings.default_dp_type is not zero3 else None,
        cp=task.vocab.cp,
    )
    t = iteration_time_s
    return Strategy(
        world_size=world_size,
        pp=task.pp,
        pp_division=task.division,
        pipeline_schedule=task.schedule,
        virtual_stages=task.virtual_stages,
        num_micro_batches=task.micro_batches,
        global_batch_size=task.batch_size,
        mixed_precision=settings.precision,
        default_dp_type=settings.default_dp_type,
        megatron_sp=settings.megatron_sp,
        layers=tuple(layers),
        vocab=vocab,
        description=(
            f"galva-search: model {model_name}, predicted {t:.6f} s per iteration, {task.batch_size / t:.3f} samples/s"
        ),
    )


def model_order(task: Task, choices: Sequence[Sequence[int]]) -> list[Candidate]:
    """The candidate of every layer in model order, from per-stage ``choices`` (stage ``s`` holds the chunks
    ``s, s + pp, ...``)."""
    division, pp = task.division, task.pp
    starts = [sum(division[:k]) for k in range(len(division))]
    out: list[Candidate | None] = [None] * sum(division)
    for stage, choice in enumerate(choices):
        indices = [i for k in range(stage, len(division), pp) for i in range(starts[k], starts[k] + division[k])]
        for i, index in zip(indices, choice):
            out[i] = task.tables.candidates[index]
    assert all(c is not None for c in out), "a layer without a candidate"
    return [c for c in out if c is not None]


def candidate_of(strategy: Strategy, index: int) -> Candidate:
    """The candidate that layer ``index`` of ``strategy`` runs (the inverse of :func:`to_strategy` per layer)."""
    layer = strategy.layers[index]
    ranks = strategy.ranks_per_stage
    return Candidate(
        pp=strategy.pp,
        tp=layer.tp,
        dp=ranks // (layer.tp * layer.cp),
        consecutive=tp_consecutive(layer.tp, ranks, layer.tp_consecutive),
        dp_type=strategy.layer_dp_type(index),
        ulysses=layer.ulysses,
        checkpoint=layer.checkpoint,
        ep=layer.ep,
        etp=layer.etp,
        expert_dp_type=layer.expert_dp_type,
        cp=layer.cp,
    )
