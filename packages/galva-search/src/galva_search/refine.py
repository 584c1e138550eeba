"""Refinements of the best pipelined plan (docs/cost-model.md §9, "Partition refinement").

* Partition: the initial partitions balance the *fastest* strategies; memory pressure (1F1B keeps more micro-batches
  on early stages) makes some stages slower than predicted once their DPs choose under the budget. From the best
  plan, one layer at a time moves from the slowest stage to a neighbour, kept while the iteration gets faster.
* Stage boundaries: a stage's DP cannot see the layer the previous stage ends with, so it leaves out the re-sharding
  after the p2p. Stage by stage, each is re-solved knowing it, kept when the whole plan gets faster.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from galva_search import dp as dp_core
from galva_search.evaluation import PlanCost
from galva_search.options import TaskRecord
from galva_search.stages import StageSolver
from galva_search.tasks import Task, TaskEnumerator

Best = tuple[float, Task, list[dp_core.StageSolution]]  # (seconds per sample, task, solution per stage)


def refine_division(
    best: Best,
    tasks: TaskEnumerator,
    solver: StageSolver,
    score: Callable[[Task, list[dp_core.StageSolution]], PlanCost],
    log: list[TaskRecord],
    counts: dict[str, int],
) -> Best:
    """Hill-climb the partition of ``best``: one layer moves from a model chunk of the slowest stage to a neighbouring
    chunk (one chunk per stage: to a neighbouring stage); every move tried is logged with a ``(refined)`` status."""
    per_sample, task, sols = best
    seen = {task.division}
    n = len(task.division)
    for _ in range(4 * task.pp):
        slow = int(np.argmax(score(task, sols).stage_time_s))
        moves = []
        for chunk in range(slow, n, task.pp):
            for target in (chunk - 1, chunk + 1):
                if 0 <= target < n and task.division[chunk] > 1:
                    division = list(task.division)
                    division[chunk] -= 1
                    division[target] += 1
                    if tuple(division) not in seen:
                        seen.add(tuple(division))
                        moves.append(
                            tasks.make_task(
                                task.batch_size,
                                task.micro_batches,
                                task.pp,
                                tuple(division),
                                task.vocab,
                                task.tables,
                                task.vocab_terms,
                                schedule=task.schedule,
                                virtual_stages=task.virtual_stages,
                            )
                        )
        moves = [m for m in moves if math.isfinite(m.bound_s) and m.bound_s / m.batch_size < per_sample]
        if not moves:
            break
        improved = False
        for move, move_sols in zip(moves, solver.solve(moves)):
            record = move.record("infeasible (refined)")
            solved = [s for s in move_sols if s is not None]
            if len(solved) == len(move_sols):
                t = score(move, solved).iteration_time_s
                record.status, record.time_s = "solved (refined)", t
                counts["refined"] = counts.get("refined", 0) + 1
                if t / move.batch_size < per_sample:
                    per_sample, task, sols, improved = t / move.batch_size, move, solved, True
            log.append(record)
        if not improved:
            break
    return per_sample, task, sols


def refine_boundaries(
    best: Best,
    solver: StageSolver,
    score: Callable[[Task, list[dp_core.StageSolution]], PlanCost],
    log: list[TaskRecord],
    counts: dict[str, int],
) -> Best:
    """Re-solve every stage of ``best`` that receives from another chunk with the exact cost of re-sharding what
    arrives (stages 1, 2, ... in order; with interleaving stage 0 too, its later chunks fed by the last stage); an
    improvement updates the task's line of the log."""
    per_sample, task, sols = best
    layers = solver.tasks.layers
    stage_layers = layers.stage_layers(task.division, task.pp)
    starts = layers.stage_chunk_starts(task.division, task.pp)
    stages = [*range(1, task.pp), *([0] if task.virtual_stages > 1 else [])]
    for stage in stages:
        candidate = {i: s for st, sol in enumerate(sols) for i, s in zip(stage_layers[st], sol.choice)}
        before = {pos: candidate[stage_layers[stage][pos] - 1] for pos in starts[stage] if stage_layers[stage][pos] > 0}
        again = solver.solve_after(task, stage, before)
        if again is None or again.choice == sols[stage].choice:
            continue
        trial = [*sols[:stage], again, *sols[stage + 1 :]]
        t = score(task, trial).iteration_time_s
        if t / task.batch_size < per_sample:
            per_sample, sols = t / task.batch_size, trial
            counts["refined"] = counts.get("refined", 0) + 1
            _record_of(task, log).time_s = t  # the same task, now with its better plan
    return per_sample, task, sols


def _record_of(task: Task, log: list[TaskRecord]) -> TaskRecord:
    """The log line of a solved task (the last one: a refined partition is logged after the task it came from)."""
    key = (task.batch_size, task.micro_batches, task.pp, task.division, task.vocab.label(), task.schedule_label)
    for record in reversed(log):
        same = (
            record.batch_size, record.micro_batches, record.pp, record.division, record.vocab, record.schedule
        ) == key
        if same and record.status.startswith("solved"):
            return record
    raise AssertionError(f"no log line for the solved task {key}")
