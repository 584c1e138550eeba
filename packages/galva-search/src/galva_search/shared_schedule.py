"""A schedule's step where ranks share a node's processors, simulated step by step (docs/cost-model.md §7).

The closed forms of :func:`~galva_search.pipeline_costs.shared_pipeline_time` bound such a step from below twice: the
critical path at a rank's speed alone, and the node's work with every rank busy. Between the two lies what neither
sees: while the pipeline fills and drains, fewer ranks can run than the processors could serve, and that capacity is
lost. :func:`shared_schedule_time` runs every stage's steps in the runtime's own order (galva-comm's
:func:`~galva_comm.schedules.schedule_order`, which galva-hp executes), a receive waiting for its sender, with the
ranks that can run sharing their node's capacity: ``N/σ`` ranks' worth of speed alone for the node's ``N`` ranks
(``σ`` the profile's every-rank-at-once slowdown), each computing rank at ``min(1, (N/σ)/n)`` of its speed alone when
``n`` of them compute. Given the node's ``P`` processors (fewer than its ranks), ``n ≤ P`` computing ranks each have
one, at their speed alone, and the capacity goes from ``P`` to ``N/σ`` as ``n`` goes from ``P`` to ``N``: 4 ranks
on 2 processors pay the every-rank-busy slowdown only while more than 2 compute (a layer loop, 73 alternating
rounds: 2 processes at once took 1.04x its time alone, 4 at once 2.06x). A step computes, then spends its other time
(collectives, p2p latency) without a processor, at its own pace. Stage replicas (a stage's dp and tp ranks) run in
lockstep and count once per rank.

Measured on the quickstart's tiny-llama (4 gloo ranks, 2 processors; benchmarks/runtime/trace_run.py, each step's
per-op CPU times replayed): pp 4 with 4 micro-batches took 1.10-1.13x the every-rank-busy bound, pp 2 with 2
micro-batches 1.01-1.04x; the simulation gives the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from galva_comm.schedules import Step, schedule_order
from galva_schema import PipelineSchedule

__all__ = ["shared_schedule_time"]


@lru_cache(maxsize=256)
def _program(schedule: PipelineSchedule, pp: int, c: int, v: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per stage, its steps as ``(kind, id of the step it waits for or -1)``; a step's id is its position in the
    stages' orders laid end to end."""
    orders = [schedule_order(schedule, s, pp, c, v) for s in range(pp)]
    ids: dict[Step, int] = {}
    for order in orders:
        for step in order:
            ids[step] = len(ids)
    last = pp * v - 1

    def needs(step: Step) -> int:
        kind, chunk, k = step
        if kind == "F":
            return -1 if chunk == 0 else ids[Step("F", chunk - 1, k)]
        if kind == "W":
            return ids[Step("I", chunk, k)]
        if chunk == last:
            return ids[Step("F", chunk, k)]
        return ids.get(Step("B", chunk + 1, k), ids.get(Step("I", chunk + 1, k), -1))

    return tuple(tuple((step.kind, needs(step)) for step in order) for order in orders)


def shared_schedule_time(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    weight_grad_s: Sequence[float],
    num_micro_batches: int,
    node_stages: Sequence[Sequence[int]],
    capacity: float,
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
    virtual_stages: int = 1,
    other_share: Sequence[float] | None = None,
    processors: int | None = None,
) -> float:
    """Seconds from the first forward to the last backward step when stage ``s`` takes ``forward_s[s]`` and
    ``backward_s[s]`` per micro-batch at a rank's speed alone (over its ``v`` chunks; ``weight_grad_s[s]`` of the
    backward is zb-h1's ``W``, all compute), ``other_share[s]`` of its forward and backward is not compute (0 when not
    given), ``node_stages[n]`` lists the stage of each of node ``n``'s ranks and ``capacity`` is a node's speed with
    every rank busy, in ranks alone (``N/σ``); ``processors`` a node's processors (None: ``capacity`` whatever the
    count computing)."""
    pp = len(forward_s)
    v = virtual_stages if schedule is PipelineSchedule.INTERLEAVED_1F1B else 1
    program = _program(schedule, pp, num_micro_batches, v)
    weight = [[0] * pp for _ in node_stages]  # node -> stage -> the node's ranks in that stage
    for n, stages in enumerate(node_stages):
        for s in stages:
            weight[n][s] += 1
    nodes_of = [[n for n in range(len(node_stages)) if weight[n][s]] for s in range(pp)]
    other = [0.0] * pp if other_share is None else list(other_share)
    ranks = [len(stages) for stages in node_stages]

    def node_capacity(node: int, computing: int) -> float:
        """The node's speed, in ranks alone, with ``computing`` of its ranks computing."""
        n, p = computing, processors or 0
        if not p or p >= ranks[node]:
            return capacity
        if n <= p:
            return float(n)
        return p + (n - p) / (ranks[node] - p) * (capacity - p)

    def split(seconds: float, s: int) -> tuple[float, float]:
        return seconds * (1.0 - other[s]), seconds * other[s]

    durations = [  # kind -> (compute, other) seconds of one step of stage s
        {
            "F": split(forward_s[s] / v, s),
            "B": split(backward_s[s] / v, s),
            "I": split(backward_s[s] - weight_grad_s[s], s),
            "W": (weight_grad_s[s], 0.0),
        }
        for s in range(pp)
    ]
    first = [sum(len(order) for order in program[:s]) for s in range(pp)]  # id of each stage's first step
    done = [False] * sum(len(order) for order in program)
    position = [0] * pp
    left = [list(durations[s][program[s][0][0]]) if program[s] else [0.0, 0.0] for s in range(pp)]
    clock = 0.0
    while True:
        running = []
        for s in range(pp):
            if position[s] < len(program[s]):
                needs = program[s][position[s]][1]
                if needs < 0 or done[needs]:
                    running.append(s)
        if not running:
            if any(position[s] < len(program[s]) for s in range(pp)):
                raise RuntimeError(f"{schedule.value}: the simulated stages wait on each other")  # a schedule bug
            return clock
        computing = [s for s in running if left[s][0] > 0.0]
        busy = [sum(w[s] for s in computing) for w in weight]
        rate = [
            min([1.0] + [node_capacity(n, busy[n]) / busy[n] for n in nodes_of[s]]) if left[s][0] > 0.0 else 1.0
            for s in running
        ]
        dt = min((left[s][0] if left[s][0] > 0.0 else left[s][1]) / r for s, r in zip(running, rate))
        clock += dt
        tolerance = 1e-12 * (1.0 + clock)
        for s, r in zip(running, rate):
            phase = 0 if left[s][0] > 0.0 else 1
            left[s][phase] -= dt * r
            if left[s][phase] <= tolerance:
                left[s][phase] = 0.0
                if phase == 1 or left[s][1] <= tolerance:
                    done[first[s] + position[s]] = True
                    position[s] += 1
                    left[s] = (
                        list(durations[s][program[s][position[s]][0]]) if position[s] < len(program[s]) else [0.0, 0.0]
                    )
