"""Partition refinement of the best pipelined plan (docs/cost-model.md §9, "Partition refinement").

The initial partitions balance the *fastest* strategies; memory pressure (1F1B keeps more micro-batches on early
stages) makes some stages slower than predicted once their DPs choose under the budget. From the best plan, one layer
at a time moves from the slowest stage to a neighbour, kept while the iteration gets faster.
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
    """Hill-climb the partition of ``best``; every move tried is logged with a ``(refined)`` status."""
    per_sample, task, sols = best
    seen = {task.division}
    for _ in range(4 * task.pp):
        slow = int(np.argmax(score(task, sols).stage_time_s))
        moves = []
        for target in (slow - 1, slow + 1):
            if 0 <= target < task.pp and task.division[slow] > 1:
                division = list(task.division)
                division[slow] -= 1
                division[target] += 1
                if tuple(division) not in seen and not tasks.rules.cuts_shared(division):
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
                        )
                    )
        moves = [m for m in moves if math.isfinite(m.bound_s) and m.bound_s / m.batch_size < per_sample]
        if not moves:
            break
        improved = False
        for move, move_sols in zip(moves, solver.solve(moves)):
            record = TaskRecord(
                move.batch_size,
                move.micro_batches,
                move.pp,
                move.division,
                move.vocab.label(),
                move.bound_s,
                "infeasible (refined)",
            )
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
