"""What a pipeline schedule does to an iteration: the activations each stage holds at its peak, and the fill, drain
and gradient-sync tail around the steady micro-batches (docs/cost-model.md §4, §7), on ranks that have a device
each or that share processors (:func:`shared_pipeline_time`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from galva_schema import PipelineSchedule
from galva_search.shared_schedule import shared_schedule_time


def in_flight(pp: int, num_micro_batches: int, schedule: PipelineSchedule, virtual_stages: int = 1) -> list[float]:
    """Activations each stage holds at its peak, in micro-batches of the whole stage (the multiplier of one
    micro-batch's activations; docs/cost-model.md §4).

    pp 1: one (micro-batches run one after another). GPipe: all ``c`` (every forward runs before any backward).
    1F1B: ``min(pp - s, c)`` at stage ``s``. zb-h1: ``min(pp, c)`` on every stage (1F1B's ``pp - s`` forwards
    plus the ``s`` micro-batches whose deferred weight-gradient pass still holds their inputs). Interleaved
    1F1B with ``v`` chunks: :func:`interleaved_chunks_in_flight` micro-batch-chunks, each holding ``1/v`` of the
    stage's activations.
    """
    c = num_micro_batches
    if pp == 1:
        return [1]
    if schedule is PipelineSchedule.GPIPE:
        return [c] * pp
    if schedule is PipelineSchedule.ZB_H1:
        return [min(pp, c)] * pp
    if schedule is PipelineSchedule.INTERLEAVED_1F1B and virtual_stages > 1:
        return [n / virtual_stages for n in interleaved_chunks_in_flight(pp, c, virtual_stages)]
    return [min(pp - stage, c) for stage in range(pp)]


def interleaved_chunks_in_flight(pp: int, num_micro_batches: int, virtual_stages: int) -> list[int]:
    """Micro-batch-chunks whose activations stage ``s`` holds at its peak under Megatron's interleaved 1F1B:
    ``min(2 (pp - s - 1) + (v - 1) pp + 1, v c)`` (its warm-up forwards, then one more forward before the first
    backward; every later step runs one forward and one backward, so the count never grows again); with ``c = pp``
    every forward is a warm-up one (Megatron, galva-hp): all ``v c``."""
    v, c = virtual_stages, num_micro_batches
    if c == pp:
        return [v * c] * pp
    return [min(2 * (pp - s - 1) + (v - 1) * pp + 1, v * c) for s in range(pp)]


@dataclass(frozen=True)
class PipelineTime:
    """An iteration split into its parts (seconds): ``steady + bubble + tail = total``."""

    total: float
    steady: float  # c micro-batches of the slowest stage
    bubble: float  # fill and drain
    tail: float  # gradient synchronisation after the last backward
    slowest: int  # the stage that sets the pace


def pipeline_time(
    stage_micro_s: Sequence[float],
    stage_exposed_s: Sequence[float],
    num_micro_batches: int,
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
    virtual_stages: int = 1,
    stage_weight_grad_s: Sequence[float] | None = None,
) -> PipelineTime:
    """Seconds per iteration of a pipeline whose stage ``s`` takes ``U_s`` per micro-batch (docs §7).

    With ``k`` the slowest stage, ``T = c·U_k + bubble + tail``, the bubble being what the other stages add while
    the pipeline fills and drains:

    * 1F1B, GPipe: ``Σ_{s≠k} U_s`` (so ``T = Σ_s U_s + (c − 1)·U_k``);
    * interleaved 1F1B with ``v`` chunks per stage: ``Σ_{s≠k} U_s / v`` (fill and drain walk one chunk of each
      stage, ``1/v`` of its work; equal stages give Megatron's ``(pp − 1)·U/v``);
    * zb-h1: ``Σ_{s≠k} max(0, U_s − 2·W_s)`` with ``W_s`` the stage's weight-gradient work, deferred into the
      bubble (equal stages: the paper's ``(pp − 1)(F + B − W)``); with ``c < pp`` no stage can defer enough weight
      gradients and the 1F1B bubble is kept.

    The tail is ``max(0, max_s (E_s − lead_s))``: stage ``s`` finishes its last backward ``lead_s`` before stage 0
    (``Σ_{k<s}`` of the same per-stage bubble terms), which hides part of its exposed sync ``E_s``.
    """
    u = np.asarray(stage_micro_s, dtype=float)
    e = np.asarray(stage_exposed_s, dtype=float)
    c, pp = num_micro_batches, len(u)
    if schedule is PipelineSchedule.INTERLEAVED_1F1B and virtual_stages > 1:
        fill = u / virtual_stages
    elif schedule is PipelineSchedule.ZB_H1 and stage_weight_grad_s is not None and c >= pp:
        fill = np.maximum(0.0, u - 2.0 * np.asarray(stage_weight_grad_s, dtype=float))
    else:
        fill = u
    slowest = int(np.argmax(u))
    bubble = float(fill.sum() - fill[slowest])
    lead = np.concatenate([[0.0], np.cumsum(fill)[:-1]])
    tail = max(0.0, float(np.max(e - lead)))
    steady = float(c * u[slowest])
    return PipelineTime(steady + bubble + tail, steady, bubble, tail, slowest)


@dataclass(frozen=True)
class SharedProcessors:
    """Ranks that share a node's processors (the hardware profile's ``shares_processors``): ``slowdown`` is the
    profile's ``compute_slowdown`` (every rank computing at once against one alone), ``ranks_per_node`` the node's
    ranks, ``processors`` its processors (``processors_per_node``) and ``stage_size`` the ranks of one pipeline stage
    (stage ``s`` holds ranks ``s·stage_size`` on, node-major numbering: galva_comm.layout.stage_ranks)."""

    slowdown: float
    ranks_per_node: int
    stage_size: int
    processors: int | None = None  # a node's processors (the simulation's capacity below every rank busy)

    def busy_share(self, pp: int) -> float:
        """The share of the every-rank-busy time ``c · mean U`` that prices a plan of ``pp`` stages: 1 for one stage
        (every rank computes through the whole step, at the measured all-at-once speed); with several stages the
        simulation prices the phases in which every rank computes, and the busy term bounds the node's work at its
        best capacity, ``max(P, N/σ)`` ranks alone: ``P`` processors run ``P`` ranks at their speed alone. Without
        it a 2-stage plan of one micro-batch, half its ranks computing at any time, was priced as if all were."""
        per = min(self.ranks_per_node, pp * self.stage_size)
        if pp <= 1 or not self.processors or self.processors >= per:
            return 1.0
        full = per / self.slowdown
        return full / max(full, float(self.processors))

    def node_stages(self, pp: int) -> list[list[int]]:
        """Per node, the stage of each of its ranks."""
        world = pp * self.stage_size
        per = min(self.ranks_per_node, world)
        return [[rank // self.stage_size for rank in range(first, first + per)] for first in range(0, world, per)]


def shared_pipeline_time(
    stage_micro_s: Sequence[float],
    stage_compute_s: Sequence[float],
    stage_exposed_s: Sequence[float],
    num_micro_batches: int,
    shared: SharedProcessors,
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
    virtual_stages: int = 1,
    stage_weight_grad_s: Sequence[float] | None = None,
    stage_forward_share: Sequence[float] | None = None,
) -> PipelineTime:
    """:func:`pipeline_time` where ranks share processors (docs §7): a rank idle in the bubble hands its processor
    to the others, so the bubble costs what the processors cannot absorb rather than the idle time.

    ``T = max(path, c · max_node mean_{r in node} U_r)``: the schedule's critical path with compute at the speed of
    a rank alone (``U_s − C_s (1 − 1/σ)``, ``C_s`` the compute within ``U_s``, ``σ`` the slowdown), and the node's
    work done with every rank busy (each at the measured all-at-once speed ``U``; with several stages, at the node's
    best capacity: :meth:`SharedProcessors.busy_share`). A schedule that shrinks the bubble
    then gains only while the path is the larger; what it costs in ``U`` (zb-h1's split, interleaving's messages) is
    paid in full. Neither sees the capacity lost while the pipeline fills and drains with fewer runnable ranks than
    processors: :func:`~galva_search.shared_schedule.shared_schedule_time` runs the schedule's steps with the node's
    capacity shared by the ranks that can run, and ``T`` is the largest of the three (so both bounds still hold).
    ``stage_forward_share[s]`` is the forward's share of stage ``s``'s micro-batch (1/3 when not given).
    """
    u = np.asarray(stage_micro_s, dtype=float)
    alone = (u - np.asarray(stage_compute_s, dtype=float) * (1.0 - 1.0 / shared.slowdown)).tolist()
    w = None if stage_weight_grad_s is None else [x / shared.slowdown for x in stage_weight_grad_s]
    path = pipeline_time(alone, stage_exposed_s, num_micro_batches, schedule, virtual_stages, w)
    node_stages = shared.node_stages(len(u))
    busy = max(num_micro_batches * float(np.mean(u[stages])) for stages in node_stages) * shared.busy_share(len(u))
    total = max(path.total, busy + path.tail)
    if len(u) > 1:  # one stage has no fill or drain to lose capacity in
        share = np.full(len(u), 1.0 / 3.0) if stage_forward_share is None else np.asarray(stage_forward_share, float)
        speed_alone = np.asarray(alone)
        compute_alone = np.asarray(stage_compute_s, dtype=float) / shared.slowdown
        other = np.divide(speed_alone - compute_alone, speed_alone, out=np.zeros(len(u)), where=speed_alone > 0)
        simulated = shared_schedule_time(
            (share * speed_alone).tolist(),
            ((1.0 - share) * speed_alone).tolist(),
            [0.0] * len(u) if w is None else w,
            num_micro_batches,
            node_stages,
            len(node_stages[0]) / shared.slowdown,
            schedule,
            virtual_stages,
            np.clip(other, 0.0, 1.0).tolist(),
            shared.processors,
        )
        total = max(total, simulated + path.tail)
    slowest = int(np.argmax(u))
    steady = float(num_micro_batches * u[slowest])
    # the bubble may be negative here: the processors the idle ranks handed over made the slowest stage faster
    return PipelineTime(total, steady, total - steady - path.tail, path.tail, slowest)
