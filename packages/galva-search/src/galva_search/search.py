"""The outer search (reference §6): batch size, micro-batches, pipeline degree and partition, vocabulary plan.

Every combination is a *task*. A task's time has a cheap lower bound (each layer at its fastest allowed strategy,
memory ignored) and a cheap memory test (each layer at its smallest memory); tasks are solved best-bound first in
waves through :func:`galva_search.dp.solve_many`, and the search stops as soon as no remaining task can beat the best
plan found. Stage problems that repeat (same layers, micro-batch, micro-batch count and in-flight count) are built
once, and a solution found under a larger budget that fits a smaller one is reused (it is optimal there too).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from galva_schema import DataParallelType, LayerStrategy, SchemaError, Strategy, VocabStrategy
from galva_search import dp as dp_core
from galva_search.cost_model import CostModel, LayerTerms, VocabOption, VocabTerms, iteration_time
from galva_search.partition import balanced_division, even_division
from galva_search.space import Candidate, SpaceOptions, generate_space

GIB = 1024.0
LAMBDAS = np.concatenate([[0.0], np.logspace(-10, -2, 49)])
"""Multipliers (seconds per MiB) of the Lagrangian lower bound: any value gives a valid bound, more a tighter one."""


@dataclass(frozen=True)
class SearchOptions:
    """What to search over, besides the strategy space itself."""

    memory_budget_mib: float
    batch_sizes: tuple[int, ...]
    space: SpaceOptions = field(default_factory=SpaceOptions)
    num_micro_batches: int | None = None  # fixed micro-batch count (the reference's settle_chunk)
    fine_grained: bool = True  # per-layer strategies (True) or one strategy for every layer (False)
    memory_reserve_mib: float | None = None  # None: the reference's rule, 20% of budgets above 20 GiB
    threads: int = 0  # DP threads, 0 = all cores
    wave_size: int = 16  # tasks solved per solve_many call
    partitions: tuple[str, ...] = ("even", "memory", "time")
    refine_division: bool = True  # hill-climb the best plan's partition (pp > 1)
    exhaustive: bool = False  # solve every task whose memory bound fits (no pruning by time bound): tests, debugging

    @property
    def reserve_mib(self) -> float:
        if self.memory_reserve_mib is not None:
            return self.memory_reserve_mib
        return 0.2 * self.memory_budget_mib if self.memory_budget_mib > 20 * GIB else 0.0


def batch_size_range(min_size: int, max_size: int, scale: int) -> list[int]:
    """Batch sizes ``min, min + scale, ... <= max`` with ``min`` rounded down to a multiple of ``scale`` (at least
    ``scale``), as the reference's ``set_searching_bsz`` (16..64 step 8 -> 16, 24, ..., 64; max 50 step 16 -> 48)."""
    if scale < 1 or min_size < 1 or max_size < 1:
        raise ValueError("batch sizes and scale must be >= 1")
    start = max(min_size, scale)
    start -= start % scale
    return list(range(start, max_size + 1, scale))


@dataclass
class TaskRecord:
    """One line of the search log."""

    batch_size: int
    micro_batches: int
    pp: int
    division: tuple[int, ...]
    vocab: str
    bound_s: float
    status: str  # "best", "solved", "infeasible", "pruned-bound", "pruned-memory"
    time_s: float | None = None

    def line(self) -> str:
        t = f"{self.time_s:.6f}s" if self.time_s is not None else "-"
        thr = f"{self.batch_size / self.time_s:.3f}/s" if self.time_s else "-"
        div = ",".join(map(str, self.division))
        return (
            f"bsz={self.batch_size} chunks={self.micro_batches} pp={self.pp} division=[{div}] {self.vocab} "
            f"bound={self.bound_s:.6f}s status={self.status} time={t} throughput={thr}"
        )


@dataclass
class SearchResult:
    """The best plan, its predicted cost, and what the search did."""

    strategy: Strategy
    iteration_time_s: float
    throughput: float  # samples per second
    stage_memory_mib: list[float]
    stage_time_s: list[float]  # per micro-batch
    memory_budget_mib: float
    usable_memory_mib: float
    search_time_s: float
    candidates: list[Candidate]
    vocab: VocabOption
    log: list[TaskRecord] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


class NoFeasibleStrategy(RuntimeError):
    """No plan fits the memory budget."""


@dataclass
class _Task:
    batch_size: int
    micro_batches: int
    pp: int
    division: tuple[int, ...]
    vocab: VocabOption
    bound_s: float
    tables: _Tables
    vocab_terms: list[VocabTerms]


@dataclass
class _Tables:
    """Layer terms of every layer type for one (pp, micro-batch, micro-batch count), over the allowed candidates."""

    candidates: list[Candidate]
    index: list[int]  # position of each allowed candidate in the pp's candidate list
    terms: list[LayerTerms]
    redistribution: list[np.ndarray]
    penalty: list[np.ndarray]
    fastest: list[int]
    dual: dict = field(default_factory=dict)


class Planner:
    """Runs the search for one cost model and set of options."""

    def __init__(
        self,
        cost: CostModel,
        options: SearchOptions,
        *,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.cost = cost
        self.options = options
        self.progress = progress
        self.world = cost.world_size
        self.settings = cost.settings
        self.model = cost.model
        self.layer_types = [lt for lt in self.model.layer_types]
        self.layer_type_of = [t for t, lt in enumerate(self.layer_types) for _ in range(lt.num_layers)]
        self.num_layers = len(self.layer_type_of)
        self.usable_mib = options.memory_budget_mib - options.reserve_mib
        space = generate_space(self.world, options.space)
        self.by_pp: dict[int, list[Candidate]] = {}
        for c in space:
            self.by_pp.setdefault(c.pp, []).append(c)
        self._check_vocab_profile()
        self._tables: dict[tuple[int, int, bool], _Tables | None] = {}
        self._problems: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._division_cache: dict[tuple, list[tuple[int, ...]]] = {}
        self._vocab_cache: dict[tuple, list[VocabTerms]] = {}
        self._bound_cache: dict[tuple, list[float] | None] = {}
        self._counts_cache: dict[tuple[int, ...], list[list[tuple[int, int]]]] = {}
        self._solutions: dict[tuple, list[tuple[float, dp_core.StageSolution | None]]] = {}
        self.counts = {"tasks": 0, "solved": 0, "infeasible": 0, "pruned_bound": 0, "pruned_memory": 0,
                       "dp_problems": 0, "dp_reused": 0}

    def _check_vocab_profile(self) -> None:
        """Every pipeline degree in the space needs the vocabulary entries of vocab tp 1 where its stages sit."""
        vocab = self.model.vocab
        for pp in self.by_pp:
            names = ["memory_pp_off"] if pp == 1 else ["memory_pp_first", "memory_pp_last"]
            for name in names:
                memory = getattr(vocab, name)
                for table in ("model_states_mib", "activation_mib_per_sample"):
                    if 1 not in getattr(memory, table):
                        raise SchemaError(
                            f"vocab.{name}.{table}: no entry for vocab tp 1 (needed for pp {pp})",
                            source=self.cost.model_source,
                        )

    # ------------------------------------------------------------------------------------------------ tables
    def tables(self, pp: int, micro_batch: int, accumulating: bool) -> _Tables | None:
        key = (pp, micro_batch, accumulating)
        if key in self._tables:
            return self._tables[key]
        pool = self.by_pp.get(pp, [])
        index = [i for i, c in enumerate(pool) if micro_batch % c.dp == 0]
        if not index:
            self._tables[key] = None
            return None
        allowed = [pool[i] for i in index]
        c = 2 if accumulating else 1  # only "more than one" matters for the terms themselves
        terms, redis, pen, fastest = [], [], [], []
        for t in range(len(self.layer_types)):
            lt = self.cost.layer_terms(t, allowed, micro_batch, c)
            terms.append(lt)
            redis.append(self.cost.redistribution(t, allowed, micro_batch))
            pen.append(self.cost.switch_penalties(t, allowed))
            fastest.append(int(np.argmin(lt.micro_batch_s)))
        table = _Tables(allowed, index, terms, redis, pen, fastest)
        self._tables[key] = table
        return table

    # ------------------------------------------------------------------------------------------------ tasks
    def _types_in(self, division: Sequence[int]) -> list[list[int]]:
        out, start = [], 0
        for count in division:
            out.append(self.layer_type_of[start : start + count])
            start += count
        return out

    def _runs(self) -> list[tuple[int, int]]:
        """The model as runs of layers of one type: ``(type, count)``."""
        return [(t, lt.num_layers) for t, lt in enumerate(self.layer_types)]

    def _divisions(self, pp: int, tables: _Tables, c: int, vocab: list[VocabTerms]) -> list[tuple[int, ...]]:
        L = self.num_layers
        if pp == 1:
            return [(L,)]
        in_flight = self.cost.in_flight(pp, c)
        key = (pp, id(tables), tuple(in_flight), tuple(round(v.memory_mib) for v in vocab),
               tuple(round(v.micro_batch_s, 6) for v in vocab))
        hit = self._division_cache.get(key)
        if hit is not None:
            return hit
        out: list[tuple[int, ...]] = []
        if "even" in self.options.partitions:
            out.append(tuple(even_division(L, pp)))
        if "memory" in self.options.partitions:
            runs = []
            for t, count in self._runs():
                terms, f = tables.terms[t], tables.fastest[t]
                runs.append((count, [float(terms.states_mib[f] + n * terms.activation_mib[f]) for n in in_flight]))
            got = balanced_division(runs, [v.memory_mib for v in vocab])
            if got:
                out.append(tuple(got))
        if "time" in self.options.partitions:
            runs = [
                (count, [float(tables.terms[t].micro_batch_s[tables.fastest[t]])] * pp) for t, count in self._runs()
            ]
            got = balanced_division(runs, [v.micro_batch_s for v in vocab])
            if got:
                out.append(tuple(got))
        out = list(dict.fromkeys(out))
        self._division_cache[key] = out
        return out

    def _enumerate(self) -> list[_Task]:
        o = self.options
        tasks: list[_Task] = []
        allow_sp = o.space.sp_space in ("tp+sp", "sp") and not o.space.disable_vtp
        allow_zero3 = not o.space.disable_sdp and self.settings.default_dp_type is not DataParallelType.ZERO3
        vocab_by_pp = {
            pp: self.cost.vocab_options(
                pp, o.space.max_tp, allow_sp=allow_sp, allow_zero3=allow_zero3, allow_tp=not o.space.disable_vtp
            )
            for pp in self.by_pp
        }
        for batch in o.batch_sizes:
            chunk_list = [o.num_micro_batches] if o.num_micro_batches else _divisors(batch)
            for c in chunk_list:
                if batch % c:
                    continue
                micro = batch // c
                for pp in sorted(self.by_pp):
                    if pp > self.num_layers:
                        continue
                    tables = self.tables(pp, micro, c > 1)
                    if tables is None:
                        continue
                    stage_ranks = self.world // pp
                    in_flight = self.cost.in_flight(pp, c)
                    for option in vocab_by_pp[pp]:
                        if micro % (stage_ranks // option.tp):
                            continue
                        vkey = (pp, option, micro, c > 1, in_flight[0], in_flight[-1])
                        vt = self._vocab_cache.get(vkey)
                        if vt is None:
                            vt = self._vocab_cache[vkey] = self.cost.vocab_terms(pp, option, micro, c, in_flight)
                        for division in self._divisions(pp, tables, c, vt):
                            tasks.append(self._make_task(batch, c, pp, division, option, tables, vt))
        return tasks

    def _type_counts(self, division: tuple[int, ...]) -> list[list[tuple[int, int]]]:
        """Per stage, ``(type, count)`` of the layers it holds."""
        hit = self._counts_cache.get(division)
        if hit is None:
            hit = []
            for types in self._types_in(division):
                counts: dict[int, int] = {}
                for t in types:
                    counts[t] = counts.get(t, 0) + 1
                hit.append(sorted(counts.items()))
            self._counts_cache[division] = hit
        return hit

    def _dual(self, tables: _Tables, t: int, n: int) -> tuple[np.ndarray, float]:
        """``g(lam) = min_s (U(s) + lam * M(s))`` over the multiplier grid, and ``min_s M(s)``, for one layer of
        type ``t`` holding ``n`` micro-batches (U: seconds per micro-batch, M: MiB)."""
        key = (t, n)
        hit = tables.dual.get(key)
        if hit is None:
            terms = tables.terms[t]
            mem = terms.memory_mib(n)
            g = (terms.micro_batch_s[None, :] + LAMBDAS[:, None] * mem[None, :]).min(axis=1)
            hit = (g, float(mem.min()))
            tables.dual[key] = hit
        return hit

    def _make_task(
        self,
        batch: int,
        c: int,
        pp: int,
        division: tuple[int, ...],
        option: VocabOption,
        tables: _Tables,
        vt: list[VocabTerms],
    ) -> _Task:
        """A task with its lower bound on the iteration time (inf when some stage cannot fit at all).

        Per stage, weak Lagrangian duality bounds the per-micro-batch time of any plan that fits the stage budget B:
        ``U >= max_lam sum_l min_s (U_ls + lam * M_ls) - lam * B`` (lam = 0 is the fastest-strategy bound);
        redistribution and p2p costs are >= 0 and left out. The iteration time is monotone in every U_s. The stage
        bounds depend on the micro-batch count only through the in-flight counts, so they are shared between tasks.
        """
        in_flight = self.cost.in_flight(pp, c)
        key = (id(tables), tuple(in_flight), option, division)
        if key in self._bound_cache:
            stage_u = self._bound_cache[key]
        else:
            stage_u = []
            for s, counts in enumerate(self._type_counts(division)):
                budget = self.usable_mib - vt[s].memory_mib - self.settings.context_mib
                total = np.zeros(len(LAMBDAS))
                min_mem = 0.0
                for t, count in counts:
                    g, m = self._dual(tables, t, in_flight[s])
                    total += count * g
                    min_mem += count * m
                if min_mem > budget:
                    stage_u = None
                    break
                stage_u.append(vt[s].micro_batch_s + float(np.max(total - LAMBDAS * budget)))
            self._bound_cache[key] = stage_u
        bound = math.inf if stage_u is None else sum(stage_u) + (c - 1) * max(stage_u)
        return _Task(batch, c, pp, tuple(division), option, bound, tables, vt)

    # ------------------------------------------------------------------------------------------------ stages
    def _stage_problem(self, task: _Task, stage: int) -> tuple[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        c = task.micro_batches
        pp = task.pp
        types = self._types_in(task.division)[stage]
        in_flight = self.cost.in_flight(pp, c)[stage]
        micro = task.batch_size // c
        first_recv = stage > 0
        last_send = stage < pp - 1
        key = (pp, micro, c, in_flight, tuple(types), first_recv, last_send)
        hit = self._problems.get(key)
        if hit is not None:
            return key, hit
        tables = task.tables
        L = len(types)
        S = len(tables.candidates)
        intra = np.empty((L, S))
        memory = np.empty((L, S))
        inter = np.zeros((L, S, S))
        for pos, t in enumerate(types):
            terms = tables.terms[t]
            row = c * terms.micro_batch_s + terms.exposed_sync_s
            if pos == 0 and first_recv:
                row = row + c * terms.p2p_s  # backward gradient sent to the previous stage
            if pos == L - 1 and last_send:
                row = row + c * terms.p2p_s  # forward activation sent to the next stage
            intra[pos] = row
            memory[pos] = terms.memory_mib(in_flight)
            if pos > 0:
                inter[pos] = c * tables.redistribution[t] + tables.penalty[t]
        value = (intra, memory, inter)
        self._problems[key] = value
        return key, value

    def _cached(self, key: tuple, budget: float) -> tuple[bool, dp_core.StageSolution | None]:
        for solved_budget, solution in self._solutions.get(key, ()):
            if solution is None and solved_budget >= budget:
                return True, None
            if solution is not None and solved_budget >= budget and solution.memory_mib <= budget:
                return True, solution
            if solved_budget == budget:
                return True, solution
        return False, None

    def _stage_budgets(self, task: _Task) -> list[float]:
        return [self.usable_mib - task.vocab_terms[s].memory_mib - self.settings.context_mib for s in range(task.pp)]

    def _solve_wave(self, wave: list[_Task]) -> list[list[dp_core.StageSolution | None]]:
        pending: dict[tuple, tuple[tuple, float, tuple]] = {}
        for task in wave:
            for stage, budget in enumerate(self._stage_budgets(task)):
                key, arrays = self._stage_problem(task, stage)
                found, _ = self._cached(key, budget)
                if found:
                    self.counts["dp_reused"] += 1
                elif (key, budget) not in pending:
                    pending[(key, budget)] = (key, budget, arrays)
        if pending:
            items = list(pending.values())
            problems = [dp_core.StageProblem(a[0], a[1], a[2], budget) for _, budget, a in items]
            self.counts["dp_problems"] += len(problems)
            solutions = dp_core.solve_many(problems, threads=self.options.threads)
            for (key, budget, _), sol in zip(items, solutions):
                self._solutions.setdefault(key, []).append((budget, sol))
        out = []
        for task in wave:
            per_stage = []
            for stage, budget in enumerate(self._stage_budgets(task)):
                key, _ = self._stage_problem(task, stage)
                found, sol = self._cached(key, budget)
                assert found
                per_stage.append(sol)
            out.append(per_stage)
        return out

    def _solve_global(self, task: _Task) -> list[dp_core.StageSolution | None]:
        """One strategy for every layer: try each allowed candidate, keep the fastest that fits every stage."""
        budgets = self._stage_budgets(task)
        S = len(task.tables.candidates)
        best: tuple[float, int] | None = None
        for s in range(S):
            sols = []
            for stage, budget in enumerate(budgets):
                _, (intra, memory, _) = self._stage_problem(task, stage)
                choice = (s,) * intra.shape[0]
                mem = float(memory[:, s].sum())
                if mem > budget:
                    break
                sols.append(dp_core.StageSolution(choice, float(intra[:, s].sum()), mem))
            else:
                t = self._evaluate(task, sols)[0]
                if best is None or t < best[0]:
                    best = (t, s)
        if best is None:
            return [None] * task.pp
        out: list[dp_core.StageSolution | None] = []
        for stage in range(task.pp):
            _, (intra, memory, _) = self._stage_problem(task, stage)
            s = best[1]
            choice = (s,) * intra.shape[0]
            out.append(dp_core.StageSolution(choice, float(intra[:, s].sum()), float(memory[:, s].sum())))
        return out

    # ------------------------------------------------------------------------------------------------ evaluation
    def _evaluate(self, task: _Task, solutions: Sequence[dp_core.StageSolution]) -> tuple[float, list, list]:
        """Iteration time (s), per-stage memory (MiB) and per-stage micro-batch time (s) of a solved task."""
        c = task.micro_batches
        micro = task.batch_size // c
        tables = task.tables
        u_list, e_list, mem_list = [], [], []
        for stage, (types, sol) in enumerate(zip(self._types_in(task.division), solutions)):
            vt = task.vocab_terms[stage]
            u, e = vt.micro_batch_s, vt.exposed_sync_s
            n = self.cost.in_flight(task.pp, c)[stage]
            mem = vt.memory_mib + self.settings.context_mib
            prev = None
            for pos, (t, s) in enumerate(zip(types, sol.choice)):
                terms = tables.terms[t]
                u += float(terms.micro_batch_s[s])
                e += float(terms.exposed_sync_s[s])
                mem += float(terms.memory_mib(n)[s])
                if prev is not None:
                    u += float(tables.redistribution[t][prev, s])
                if pos == 0 and stage > 0:
                    u += float(terms.p2p_s[s])
                if pos == len(types) - 1 and stage < task.pp - 1:
                    u += float(terms.p2p_s[s])
                prev = s
            u_list.append(u)
            e_list.append(e)
            mem_list.append(mem)
        del micro
        return iteration_time(u_list, e_list, c), mem_list, u_list

    def _refine_division(
        self, best: tuple[float, _Task, list[dp_core.StageSolution]], log: list[TaskRecord]
    ) -> tuple[float, _Task, list[dp_core.StageSolution]]:
        """Hill-climb the partition of the best plan: move one layer from the slowest stage (per micro-batch, after
        its DP chose strategies under its memory budget) to a neighbour, keep the move if the iteration gets faster.
        The initial partitions balance the *fastest* strategies; memory pressure (1F1B keeps more micro-batches on
        early stages) makes some stages slower than predicted, which this corrects."""
        per_sample, task, sols = best
        seen = {task.division}
        for _ in range(4 * task.pp):
            _, _, stage_u = self._evaluate(task, sols)
            slow = int(np.argmax(stage_u))
            moves = []
            for target in (slow - 1, slow + 1):
                if 0 <= target < task.pp and task.division[slow] > 1:
                    division = list(task.division)
                    division[slow] -= 1
                    division[target] += 1
                    if tuple(division) not in seen:
                        seen.add(tuple(division))
                        moves.append(self._make_task(task.batch_size, task.micro_batches, task.pp, tuple(division),
                                                     task.vocab, task.tables, task.vocab_terms))
            moves = [m for m in moves if math.isfinite(m.bound_s) and m.bound_s / m.batch_size < per_sample]
            if not moves:
                break
            improved = False
            for move, move_sols in zip(moves, self._solve_wave(moves)):
                record = TaskRecord(move.batch_size, move.micro_batches, move.pp, move.division, move.vocab.label(),
                                    move.bound_s, "infeasible (refined)")
                solved = [s for s in move_sols if s is not None]
                if len(solved) == len(move_sols):
                    t, _, _ = self._evaluate(move, solved)
                    record.status, record.time_s = "solved (refined)", t
                    self.counts["refined"] = self.counts.get("refined", 0) + 1
                    if t / move.batch_size < per_sample:
                        per_sample, task, sols, improved = t / move.batch_size, move, solved, True
                log.append(record)
            if not improved:
                break
        return per_sample, task, sols

    # ------------------------------------------------------------------------------------------------ driver
    def run(self) -> SearchResult:
        start = time.perf_counter()
        tasks = self._enumerate()
        self.counts["tasks"] = len(tasks)
        if not tasks:
            o = self.options
            chunks = f", {o.num_micro_batches} micro-batches" if o.num_micro_batches else ""
            raise NoFeasibleStrategy(
                f"no feasible strategy: no valid combination for global batch sizes {list(o.batch_sizes)}{chunks} "
                f"on {self.world} devices (a micro-batch must split evenly over the data-parallel degree of some "
                f"strategy and of the vocabulary layers); change the batch size or the number of micro-batches"
            )
        # best throughput first: smallest lower bound on seconds per sample
        tasks.sort(key=lambda t: (t.bound_s / t.batch_size, t.pp, t.micro_batches))
        log: list[TaskRecord] = []
        best: tuple[float, _Task, list[dp_core.StageSolution]] | None = None  # (s per sample, task, solutions)
        done = 0
        i = 0
        def beaten(task: _Task) -> bool:
            if not math.isfinite(task.bound_s):
                return True
            return not self.options.exhaustive and best is not None and task.bound_s / task.batch_size >= best[0]

        while i < len(tasks) and not beaten(tasks[i]):
            wave: list[_Task] = []
            while i < len(tasks) and len(wave) < self.options.wave_size and not beaten(tasks[i]):
                wave.append(tasks[i])
                i += 1
            if self.options.fine_grained:
                results = self._solve_wave(wave)
            else:
                results = [self._solve_global(task) for task in wave]
            for task, sols in zip(wave, results):
                record = TaskRecord(task.batch_size, task.micro_batches, task.pp, task.division,
                                    task.vocab.label(), task.bound_s, "infeasible")
                solved = [s for s in sols if s is not None]
                if len(solved) == len(sols):
                    t, _, _ = self._evaluate(task, solved)
                    record.status, record.time_s = "solved", t
                    self.counts["solved"] += 1
                    if best is None or t / task.batch_size < best[0]:
                        best = (t / task.batch_size, task, solved)
                else:
                    self.counts["infeasible"] += 1
                log.append(record)
            done += len(wave)
            if self.progress:
                thr = f"{1.0 / best[0]:.3f} samples/s" if best else "none yet"
                self.progress(f"search: {done} of {len(tasks)} tasks evaluated, best {thr}")
        for task in tasks[i:]:
            status = "pruned-memory" if not math.isfinite(task.bound_s) else "pruned-bound"
            self.counts["pruned_memory" if status == "pruned-memory" else "pruned_bound"] += 1
            log.append(TaskRecord(task.batch_size, task.micro_batches, task.pp, task.division, task.vocab.label(),
                                  task.bound_s, status))
        if best is None:
            raise NoFeasibleStrategy(self._infeasible_message())
        if self.options.fine_grained and self.options.refine_division and best[1].pp > 1:
            best = self._refine_division(best, log)
        _, task, best_sols = best
        t, mem, stage_u = self._evaluate(task, best_sols)
        for record in log:
            if record.status.startswith("solved") and record.time_s == t and record.division == task.division:
                record.status = "best"
                break
        strategy = self._to_strategy(task, best_sols, t)
        return SearchResult(
            strategy=strategy,
            iteration_time_s=t,
            throughput=task.batch_size / t,
            stage_memory_mib=mem,
            stage_time_s=stage_u,
            memory_budget_mib=self.options.memory_budget_mib,
            usable_memory_mib=self.usable_mib,
            search_time_s=time.perf_counter() - start,
            candidates=[task.tables.candidates[s] for sol in best_sols for s in sol.choice],
            vocab=task.vocab,
            log=log,
            counts=dict(self.counts),
        )

    def _infeasible_message(self) -> str:
        o = self.options
        budget = o.memory_budget_mib
        reserve = o.reserve_mib
        batches = o.batch_sizes
        shown = f"{batches[0]}" if len(batches) == 1 else f"{batches[0]}..{batches[-1]}"
        return (
            f"no feasible strategy: nothing fits the memory budget of {budget:.0f} MiB per device "
            f"({budget / GIB:.2f} GiB, {reserve:.0f} MiB of it reserved) for global batch size {shown} "
            f"on {self.world} devices; raise --memory, lower the batch size, or widen the search space"
        )

    def _to_strategy(self, task: _Task, sols: Sequence[dp_core.StageSolution], t: float) -> Strategy:
        s = self.settings
        layers = []
        stage_ranks = self.world // task.pp
        for sol in sols:
            for index in sol.choice:
                cand = task.tables.candidates[index]
                consecutive = cand.consecutive or cand.tp in (1, stage_ranks)
                layers.append(
                    LayerStrategy(
                        tp=cand.tp,
                        tp_consecutive=consecutive,
                        ulysses=cand.ulysses,
                        dp_type=None if cand.dp_type is s.default_dp_type else cand.dp_type,
                        checkpoint=cand.checkpoint,
                    )
                )
        vocab = VocabStrategy(
            tp=task.vocab.tp,
            sp=task.vocab.sp,
            dp_type=DataParallelType.ZERO3 if task.vocab.zero3 and s.default_dp_type is not DataParallelType.ZERO3
            else None,
        )
        return Strategy(
            world_size=self.world,
            pp=task.pp,
            pp_division=task.division,
            pipeline_schedule=s.pipeline_schedule,
            num_micro_batches=task.micro_batches,
            global_batch_size=task.batch_size,
            mixed_precision=s.precision,
            default_dp_type=s.default_dp_type,
            megatron_sp=s.megatron_sp,
            layers=tuple(layers),
            vocab=vocab,
            description=(
                f"galva-search: model {self.model.model_name}, predicted {t:.6f} s per iteration, "
                f"{task.batch_size / t:.3f} samples/s"
            ),
        )


def search(cost: CostModel, options: SearchOptions, *, progress: Callable[[str], None] | None = None) -> SearchResult:
    """Find the fastest plan; raises :class:`NoFeasibleStrategy` when nothing fits the budget."""
    if options.memory_budget_mib <= 0:
        raise ValueError("memory budget must be positive")
    if not options.batch_sizes:
        raise ValueError("no batch size to search")
    return Planner(cost, options, progress=progress).run()


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))



@dataclass(frozen=True)
class Evaluation:
    """Predicted cost of one given strategy."""

    iteration_time_s: float
    throughput: float  # samples per second
    stage_memory_mib: list[float]


def evaluate_strategy(cost: CostModel, strategy: Strategy) -> Evaluation:
    """Predict iteration time, throughput and per-stage memory of ``strategy`` (hand-written, or another tool's).

    Uses the same terms the search optimises; the cost model's settings (precision, schedule, default dp type,
    Megatron-SP) are taken from the strategy, so a plan is always scored as it would run.
    """
    if strategy.world_size != cost.world_size:
        raise SchemaError(f"world_size: the strategy has {strategy.world_size} ranks, the cluster {cost.world_size}")
    if strategy.num_layers != cost.model.num_layers:
        raise SchemaError(f"layers: the strategy has {strategy.num_layers} layers, the model {cost.model.num_layers}")
    settings = replace(
        cost.settings,
        precision=strategy.mixed_precision,
        pipeline_schedule=strategy.pipeline_schedule,
        default_dp_type=strategy.default_dp_type,
        megatron_sp=strategy.megatron_sp,
    )
    cost = CostModel(
        cost.hardware, cost.model, settings, hardware_source=cost.comm.source, model_source=cost.model_source
    )
    default = strategy.default_dp_type
    space = SpaceOptions(
        preset="full",
        sp_space="tp+sp",
        default_dp_type=DataParallelType.ZERO2 if default is DataParallelType.ZERO2 else DataParallelType.DDP,
        max_tp=_power_of_two_at_least(max(layer.tp for layer in strategy.layers)),  # only what the plan uses
        max_pp=_power_of_two_at_least(strategy.pp),
    )
    options = SearchOptions(
        memory_budget_mib=math.inf,
        batch_sizes=(strategy.global_batch_size,),
        space=space,
        num_micro_batches=strategy.num_micro_batches,
        memory_reserve_mib=0.0,
    )
    planner = Planner(cost, options)
    c, pp = strategy.num_micro_batches, strategy.pp
    tables = planner.tables(pp, strategy.micro_batch_size, c > 1)
    if tables is None:
        raise SchemaError(f"pp: no layer plan of pp {pp} divides the micro-batch of {strategy.micro_batch_size}")
    vocab = VocabOption(
        tp=strategy.vocab.tp, sp=strategy.vocab.sp, zero3=strategy.vocab_dp_type is DataParallelType.ZERO3
    )
    vocab_terms = cost.vocab_terms(pp, vocab, strategy.micro_batch_size, c, cost.in_flight(pp, c))
    task = _Task(strategy.global_batch_size, c, pp, tuple(strategy.pp_division), vocab, 0.0, tables, vocab_terms)
    ranks_per_stage = strategy.ranks_per_stage

    def candidate_index(index: int) -> int:
        layer, dp_type = strategy.layers[index], strategy.layer_dp_type(index)
        for i, cand in enumerate(tables.candidates):
            same_layout = cand.tp in (1, ranks_per_stage) or cand.consecutive == layer.tp_consecutive
            same_dp_type = cand.dp == 1 or cand.dp_type == dp_type  # nothing to shard without data parallelism
            same_kind = (cand.tp, cand.ulysses, cand.checkpoint) == (layer.tp, layer.ulysses, layer.checkpoint)
            if same_kind and same_layout and same_dp_type:
                return i
        raise SchemaError(f"layers[{index}]: {strategy.layer_summary(index)} is outside the cost model's space")

    solutions = [
        dp_core.StageSolution(tuple(candidate_index(i) for i in strategy.stage_layers(stage)), 0.0, 0.0)
        for stage in range(pp)
    ]
    iteration, memory, _ = planner._evaluate(task, solutions)
    return Evaluation(iteration, strategy.global_batch_size / iteration, [float(m) for m in memory])


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
