"""The outer search (reference §6): batch size, micro-batches, pipeline degree, schedule and partition, vocabulary
plan.

Every combination is a task (:mod:`galva_search.tasks`) with a cheap lower bound on its time and a cheap memory
test; tasks are solved best-bound first in waves through the stage DPs (:mod:`galva_search.stages`), scored by
:func:`galva_search.evaluation.task_cost`, and the search stops as soon as no remaining task can beat the best plan
found. The best pipelined plan's partition is then refined (:mod:`galva_search.refine`) and written as a
:class:`galva_schema.Strategy` (:mod:`galva_search.convert`).

This module also re-exports the public names of those modules that callers import from ``galva_search.search``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from galva_schema import SchemaError
from galva_search import dp as dp_core
from galva_search.convert import model_order, to_strategy
from galva_search.cost_model import CostModel
from galva_search.evaluation import Evaluation, PlanCost, evaluate_strategy, task_cost
from galva_search.fit import what_would_fit
from galva_search.options import (
    GIB,
    NoFeasibleStrategy,
    SearchOptions,
    SearchResult,
    TaskRecord,
    batch_size_range,
)
from galva_search.refine import Best, refine_boundaries, refine_division
from galva_search.rules import ModelRules
from galva_search.space import Candidate, generate_space, with_expert_layouts
from galva_search.stages import StageSolver
from galva_search.summary import search_summary
from galva_search.tasks import Task, TaskEnumerator

__all__ = [
    "Evaluation",
    "NoFeasibleStrategy",
    "SearchOptions",
    "SearchResult",
    "TaskRecord",
    "batch_size_range",
    "evaluate_strategy",
    "search",
]


def search(cost: CostModel, options: SearchOptions, *, progress: Callable[[str], None] | None = None) -> SearchResult:
    """Find the fastest plan; raises :class:`NoFeasibleStrategy` when nothing fits the budget."""
    if options.memory_budget_mib <= 0:
        raise ValueError("memory budget must be positive")
    if not options.batch_sizes:
        raise ValueError("no batch size to search")
    return _Planner(cost, options, progress).run()


def _fits(cost: CostModel, options: SearchOptions) -> bool:
    """Whether the search finds a plan (no hint on failure: this is how the hint itself is found)."""
    try:
        _Planner(cost, options, None, explain=False).run()
    except NoFeasibleStrategy:
        return False
    return True


class _Planner:
    """One run of the search: the driver loop over waves of tasks, and the result. ``explain``: say what would fit
    when nothing does (by searching again)."""

    def __init__(
        self, cost: CostModel, options: SearchOptions, progress: Callable[[str], None] | None, explain: bool = True
    ) -> None:
        self.cost = cost
        self.options = options
        self.progress = progress
        self.explain = explain
        by_pp: dict[int, list[Candidate]] = {}
        experts = [(t.experts.num_experts, t.experts.expert_ffn) for t in cost.model.layer_types if t.experts]
        space = with_expert_layouts(generate_space(cost.world_size, options.space), experts, options.space.max_ep)
        for c in space:
            by_pp.setdefault(c.pp, []).append(c)
        _check_vocab_profile(cost, by_pp)
        self.counts = {
            "tasks": 0,
            "solved": 0,
            "infeasible": 0,
            "pruned_bound": 0,
            "pruned_memory": 0,
            "dp_problems": 0,
            "dp_reused": 0,
        }
        self.rules = ModelRules(cost.model, cost.settings, cost.world_size, source=cost.model_source)
        self.tasks = TaskEnumerator(cost, options, by_pp, self.rules)
        self.solver = StageSolver(self.tasks, options.threads, self.counts)

    def score(self, task: Task, solutions: Sequence[dp_core.StageSolution]) -> PlanCost:
        return task_cost(self.cost, self.tasks.layers, task, [sol.choice for sol in solutions])

    def _uniform_time(self, task: Task, choices: list[tuple[int, ...]]) -> float:
        return task_cost(self.cost, self.tasks.layers, task, choices).iteration_time_s

    def run(self) -> SearchResult:
        start = time.perf_counter()
        o = self.options
        tasks = self.tasks.enumerate()
        self.counts["tasks"] = len(tasks)
        if not tasks:
            fixed = f", {o.num_micro_batches} micro-batches" if o.num_micro_batches else ""
            raise NoFeasibleStrategy(
                f"no feasible strategy: no valid combination for global batch sizes {list(o.batch_sizes)}{fixed} "
                f"on {self.cost.world_size} devices (a micro-batch must split evenly over the data-parallel degree "
                f"of some strategy and of the vocabulary layers); change the batch size or the number of "
                f"micro-batches"
            )
        # best throughput first: smallest lower bound on seconds per sample
        tasks.sort(key=lambda t: (t.bound_s / t.batch_size, t.pp, t.micro_batches))
        log: list[TaskRecord] = []
        best: Best | None = None
        i = 0

        def beaten(task: Task) -> bool:
            if not math.isfinite(task.bound_s):
                return True
            return not o.exhaustive and best is not None and task.bound_s / task.batch_size >= best[0]

        while i < len(tasks) and not beaten(tasks[i]):
            wave: list[Task] = []
            while i < len(tasks) and len(wave) < o.wave_size and not beaten(tasks[i]):
                wave.append(tasks[i])
                i += 1
            if o.fine_grained:
                results = self.solver.solve(wave)
            else:
                results = [self.solver.solve_uniform(task, self._uniform_time) for task in wave]
            for task, sols in zip(wave, results):
                record = task.record("infeasible")
                solved = [s for s in sols if s is not None]
                if len(solved) == len(sols):
                    t = self.score(task, solved).iteration_time_s
                    record.status, record.time_s = "solved", t
                    self.counts["solved"] += 1
                    if best is None or t / task.batch_size < best[0]:
                        best = (t / task.batch_size, task, solved)
                else:
                    self.counts["infeasible"] += 1
                log.append(record)
            if self.progress:
                thr = f"{1.0 / best[0]:.3f} samples/s" if best else "none yet"
                self.progress(f"search: {i} of {len(tasks)} tasks evaluated, best {thr}")
        for task in tasks[i:]:
            status = "pruned-memory" if not math.isfinite(task.bound_s) else "pruned-bound"
            self.counts["pruned_memory" if status == "pruned-memory" else "pruned_bound"] += 1
            log.append(task.record(status))
        if best is None:
            raise NoFeasibleStrategy(self._infeasible_message())
        if o.fine_grained and o.refine_division and best[1].pp > 1:
            best = refine_division(best, self.tasks, self.solver, self.score, log, self.counts)
            best = refine_boundaries(best, self.solver, self.score, log, self.counts)
        _, task, best_sols = best
        got = self.score(task, best_sols)
        t = got.iteration_time_s
        for record in log:
            if (
                record.status.startswith("solved")
                and record.time_s == t
                and record.division == task.division
                and record.schedule == task.schedule_label
            ):
                record.status = "best"
                break
        choices = [sol.choice for sol in best_sols]
        strategy = to_strategy(self.cost.settings, self.cost.world_size, self.cost.model.model_name, task, choices, t)
        self.rules.check(strategy)  # the model's own check of the whole plan: a problem is a bug of the search
        summary = search_summary(
            strategy,
            iteration_time_s=t,
            stage_memory_mib=got.stage_memory_mib,
            stage_micro_batch_time_s=got.stage_time_s,
            time_breakdown_s=got.time_breakdown_s(task.micro_batches),
            memory_budget_mib=o.memory_budget_mib,
            usable_memory_mib=o.usable_mib,
            search_time_s=time.perf_counter() - start,
            counts=self.counts,
            base_memory_mib=self.cost.settings.context_mib,
        )
        return SearchResult(strategy=strategy, summary=summary, candidates=model_order(task, choices), log=log)

    def _infeasible_message(self) -> str:
        o = self.options
        budget, reserve, batches = o.memory_budget_mib, o.reserve_mib, o.batch_sizes
        shown = f"{batches[0]}" if len(batches) == 1 else f"{batches[0]}..{batches[-1]}"
        line = (
            f"no feasible strategy: nothing fits the memory budget of {budget:.0f} MiB per device "
            f"({budget / GIB:.2f} GiB, {reserve:.0f} MiB of it reserved) for global batch size {shown} "
            f"on {self.cost.world_size} devices"
        )
        if not self.explain:
            return line
        if self.progress:
            self.progress("search: nothing fits; searching for the batch size and the budget that would")
        return f"{line}; {what_would_fit(lambda options: _fits(self.cost, options), o)}"


def _check_vocab_profile(cost: CostModel, by_pp: dict[int, list[Candidate]]) -> None:
    """Every pipeline degree in the space needs the vocabulary entries of vocab tp 1 where its stages sit."""
    vocab = cost.model.vocab
    for pp in by_pp:
        names = ["memory_pp_off"] if pp == 1 else ["memory_pp_first", "memory_pp_last"]
        for name in names:
            memory = getattr(vocab, name)
            for table in ("model_states_mib", "activation_mib_per_sample"):
                if 1 not in getattr(memory, table):
                    raise SchemaError(
                        f"vocab.{name}.{table}: no entry for vocab tp 1 (needed for pp {pp})",
                        source=cost.model_source,
                    )
