"""A schedule's step where ranks share a node's processors, simulated step by step (docs/cost-model.md §7).

The closed forms of :func:`~galva_search.pipeline_costs.shared_pipeline_time` bound such a step from below twice: the
critical path at a rank's speed alone, and the node's work with every rank busy. Between the two lies what neither
sees: while the pipeline fills and drains, fewer ranks can run than the processors could serve, and that capacity is
lost. :func:`shared_schedule_time` runs every stage's steps in the runtime's own order (galva-comm's
:func:`~galva_comm.schedules.schedule_order`, which galva-hp executes), a receive waiting for its sender, with the
ranks that can run sharing their node's capacity: ``N/σ`` ranks' worth of speed alone for the node's ``N`` ranks
(``σ`` the profile's every-rank-at-once slowdown), each runnable rank at ``min(1, (N/σ)/n)`` of its speed alone when
``n`` of them can run. Stage replicas (a stage's dp and tp ranks) run in lockstep and count once per rank.

Measured on the quickstart's tiny-llama (4 gloo ranks, 2 processors; benchmarks/runtime/trace_run.py, each step's
per-op CPU times replayed): pp 4 with 4 micro-batches took 1.10-1.13x the every-rank-busy bound, pp 2 with 2
micro-batches 1.01-1.04x; the simulation gives the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from galva_comm.schedules import Step, schedule_order
from galva_schema import PipelineSchedule

__all__ = ["shared_schedule_time"]


def shared_schedule_time(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    weight_grad_s: Sequence[float],
    num_micro_batches: int,
    node_stages: Sequence[Sequence[int]],
    capacity: float,
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
    virtual_stages: int = 1,
) -> float:
    """Seconds from the first forward to the last backward step when stage ``s`` takes ``forward_s[s]`` and
    ``backward_s[s]`` per micro-batch at a rank's speed alone (over its ``v`` chunks; ``weight_grad_s[s]`` of the
    backward is zb-h1's ``W``), ``node_stages[n]`` lists the stage of each of node ``n``'s ranks and ``capacity`` is
    a node's speed with every rank busy, in ranks alone (``N/σ``)."""
    pp, c = len(forward_s), num_micro_batches
    v = virtual_stages if schedule is PipelineSchedule.INTERLEAVED_1F1B else 1
    last = pp * v - 1
    orders = [schedule_order(schedule, s, pp, c, v) for s in range(pp)]
    weight = [dict.fromkeys(range(pp), 0) for _ in node_stages]  # node -> stage -> its ranks there
    for n, stages in enumerate(node_stages):
        for s in stages:
            weight[n][s] += 1
    nodes_of = [[n for n in range(len(node_stages)) if weight[n][s]] for s in range(pp)]

    def duration(s: int, step: Step) -> float:
        if step.kind == "F":
            return forward_s[s] / v
        if step.kind == "W":
            return weight_grad_s[s]
        if step.kind == "I":
            return backward_s[s] - weight_grad_s[s]
        return backward_s[s] / v

    def ready(step: Step) -> bool:
        kind, chunk, k = step
        if kind == "F":
            return chunk == 0 or ("F", chunk - 1, k) in done
        if kind == "W":
            return ("I", chunk, k) in done
        if chunk == last:
            return ("F", chunk, k) in done
        return ("B", chunk + 1, k) in done or ("I", chunk + 1, k) in done

    done: set[tuple[str, int, int]] = set()
    position = [0] * pp
    left = [duration(s, orders[s][0]) if orders[s] else 0.0 for s in range(pp)]
    clock = 0.0
    while True:
        running = [s for s in range(pp) if position[s] < len(orders[s]) and ready(orders[s][position[s]])]
        if not running:
            if any(position[s] < len(orders[s]) for s in range(pp)):
                raise RuntimeError(f"{schedule.value}: the simulated stages wait on each other")  # a schedule bug
            return clock
        busy = [sum(weight[n][s] for s in running) for n in range(len(node_stages))]
        rate = {s: min([1.0] + [capacity / busy[n] for n in nodes_of[s]]) for s in running}
        dt = min(left[s] / rate[s] for s in running)
        clock += dt
        for s in running:
            left[s] -= dt * rate[s]
            if left[s] <= 1e-12 * (1.0 + clock):
                done.add(orders[s][position[s]])
                position[s] += 1
                left[s] = duration(s, orders[s][position[s]]) if position[s] < len(orders[s]) else 0.0
