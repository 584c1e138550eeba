"""The N fastest distinct plans of a search (``galva-profile check --top N`` runs them for real).

:func:`galva_search.search.search` keeps only the best plan. :func:`top_plans` runs the same outer search (same
tasks, same stage DPs, same scoring by :func:`galva_search.evaluation.task_cost`) but keeps the best plan of every
task (batch size, micro-batches, pipeline degree and partition, vocabulary plan) and returns the ``n`` fastest
distinct ones, fastest first. The first is always :func:`search`'s own answer (its pipelined partition refined);
the others are the unrefined best plans of the next-best tasks. Tasks whose lower bound cannot beat the ``n``-th
plan found are pruned, as the search prunes against its best.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass

from galva_comm.layout import tp_consecutive
from galva_schema import Strategy
from galva_search.convert import to_strategy
from galva_search.cost_model import CostModel
from galva_search.evaluation import task_cost
from galva_search.options import SearchOptions
from galva_search.rules import ModelRules
from galva_search.search import search
from galva_search.space import Candidate, generate_space
from galva_search.stages import StageSolver
from galva_search.tasks import Task, TaskEnumerator

__all__ = ["RankedPlan", "top_plans"]


@dataclass(frozen=True)
class RankedPlan:
    """One plan of :func:`top_plans`, with its predicted cost."""

    strategy: Strategy
    iteration_time_s: float
    throughput_samples_per_s: float
    stage_memory_mib: list[float]


def _key(strategy: Strategy) -> str:
    """Two plans are the same when they run the same: a data-parallel type over a data-parallel degree of 1 and the
    consecutive flag of a tp group that is 1 or the whole stage change nothing."""
    data = strategy.model_dump(mode="json", exclude={"description"})
    stage = strategy.ranks_per_stage
    for layer in data["layers"]:
        if stage // layer["tp"] == 1:
            layer["dp_type"] = None
        layer["tp_consecutive"] = tp_consecutive(layer["tp"], stage, layer["tp_consecutive"])
    if stage // data["vocab"]["tp"] == 1:
        data["vocab"]["dp_type"] = None
    return json.dumps(data, sort_keys=True)


def top_plans(cost: CostModel, options: SearchOptions, n: int) -> list[RankedPlan]:
    """The ``n`` fastest distinct plans (fewer if fewer tasks are feasible), fastest first.

    Raises:
        NoFeasibleStrategy: nothing fits (as :func:`galva_search.search.search`).
        ValueError: ``n`` < 1, or the options are invalid.
    """
    if n < 1:
        raise ValueError("top_plans: n must be >= 1")
    best = search(cost, options)
    summary = best.summary
    first = RankedPlan(
        best.strategy, summary.iteration_time_s, summary.throughput_samples_per_s, list(summary.stage_memory_mib)
    )
    if n == 1:
        return [first]
    by_pp: dict[int, list[Candidate]] = {}
    for c in generate_space(cost.world_size, options.space):
        by_pp.setdefault(c.pp, []).append(c)
    rules = ModelRules(cost.model, cost.settings, cost.world_size, source=cost.model_source)
    enumerator = TaskEnumerator(cost, options, by_pp, rules)
    counts = dict.fromkeys(("tasks", "solved", "infeasible", "dp_problems", "dp_reused"), 0)
    solver = StageSolver(enumerator, options.threads, counts)
    tasks = sorted(enumerator.enumerate(), key=lambda t: (t.bound_s / t.batch_size, t.pp, t.micro_batches))
    seen = {_key(first.strategy)}
    kept: list[tuple[float, int, RankedPlan]] = []  # max-heap on seconds per sample (negated), n - 1 entries
    order = 0

    def nth_best() -> float:
        return -kept[0][0] if len(kept) >= n - 1 else math.inf

    def uniform_time(task: Task, choices: list[tuple[int, ...]]) -> float:
        return task_cost(cost, enumerator.layers, task, choices).iteration_time_s

    i = 0
    while i < len(tasks):
        wave: list[Task] = []
        while i < len(tasks) and len(wave) < options.wave_size:
            task = tasks[i]
            i += 1
            if math.isfinite(task.bound_s) and (options.exhaustive or task.bound_s / task.batch_size < nth_best()):
                wave.append(task)
        if not wave:
            break
        if options.fine_grained:
            results = solver.solve(wave)
        else:
            results = [solver.solve_uniform(task, uniform_time) for task in wave]
        for task, sols in zip(wave, results):
            solved = [s for s in sols if s is not None]
            if len(solved) != len(sols):
                continue
            choices = [sol.choice for sol in solved]
            got = task_cost(cost, enumerator.layers, task, choices)
            t = got.iteration_time_s
            if t / task.batch_size >= nth_best():
                continue
            strategy = to_strategy(cost.settings, cost.world_size, cost.model.model_name, task, choices, t)
            key = _key(strategy)
            if key in seen:
                continue
            rules.check(strategy)
            seen.add(key)
            order += 1
            plan = RankedPlan(strategy, t, task.batch_size / t, [float(m) for m in got.stage_memory_mib])
            heapq.heappush(kept, (-t / task.batch_size, order, plan))
            if len(kept) > n - 1:
                dropped = heapq.heappop(kept)
                seen.discard(_key(dropped[2].strategy))
    rest = sorted((plan for _, _, plan in kept), key=lambda p: (-p.throughput_samples_per_s, p.iteration_time_s))
    return [first, *rest]
