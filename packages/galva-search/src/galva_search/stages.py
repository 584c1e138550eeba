"""The stage problems of tasks and their solutions by the DP core (docs/cost-model.md §9, "Per stage").

A stage problem is the DP input of one pipeline stage: per layer and candidate, the time over the iteration and the
memory; per pair of neighbouring layers, the transition cost. Problems that repeat between tasks (same pipeline
degree, micro-batch, micro-batch count, in-flight count, layer types and chunk flags) are built once; a solution
found under a larger budget that fits a smaller one is reused (it is optimal there too).

Transients (a ZeRO-3 layer's gathered parameters, a checkpointed layer's recomputation) are held by one layer at a
time, so a plan's peak adds the *largest* transient of its layers, which a sum over layers cannot express. The
solver solves one DP per transient level ``tau`` of the stage (candidates whose transient exceeds ``tau`` are
forbidden, the budget is lowered by ``tau``) and keeps the fastest: exact. Each level's problem keeps only the
candidates that no other of the same transitions matches or beats at every layer (:func:`undominated_beats`), and the
levels are solved in order of a lower bound (:func:`level_bound`) until none left can beat the best: both exact, and
what keeps expert layouts and context parallelism from multiplying the DPs.

The C++ core does all of that (``cpp/stage_levels.hpp`` through :class:`galva_search.dp.StageLevels` and
:func:`galva_search.dp.solve_stages`), and tells each level's DP the best time its stages already have so that a
level which cannot reach it stops at its dual bound; this module's functions and :meth:`StageSolver.solve_python` are
the statement of the rules it follows (the search runs them where the core is not built; the tests compare both).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from galva_search import dp as dp_core
from galva_search.tasks import Task, TaskEnumerator

StageArrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # intra [L][S] s, memory [L][S] MiB, inter [L][S][S] s
StageParts = tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]]  # intra, memory, [B][S][S] blocks, [L] block
Solutions = list[dp_core.StageSolution | None]  # per stage; None: nothing fits the stage's budget
Level = tuple[tuple, float, "StageArrays | _Lazy", np.ndarray]  # key, budget, reduced arrays, their candidates


@dataclass
class _Levels:
    """One stage's levels in a wave: their order (by lower bound), the next to solve and the best so far."""

    levels: list[Level]
    order: list[int]
    bounds: list[float]
    next: int = 0
    best_time: float = math.inf
    best: int = -1  # index into levels; -1: none fits yet


class StageSolver:
    """Builds, caches and solves the stage problems of tasks."""

    def __init__(self, tasks: TaskEnumerator, threads: int, counts: dict[str, int]) -> None:
        self.tasks = tasks
        self.cost = tasks.cost
        self.threads = threads
        self.counts = counts  # "dp_problems" and "dp_reused" are incremented here
        self._problems: dict[tuple, StageArrays] = {}
        self._parts: dict[tuple, StageParts] = {}
        self._solutions: dict[tuple, list[tuple[float, dp_core.StageSolution | None]]] = {}
        self._transients: dict[tuple, np.ndarray] = {}  # problem key -> transient MiB [L][S]
        self._classes: dict[tuple, np.ndarray] = {}  # problem key -> transition class per candidate
        self._levels: dict[tuple[tuple, float], list[Level]] = {}  # (problem key, budget) -> levels()
        self._bounds: dict[tuple[tuple, float], float] = {}  # (level key, budget) -> level_bound() of its level
        self._core_levels: dict[tuple, dp_core.StageLevels] = {}  # problem key -> its levels in the C++ core

    def stage_problem(self, task: Task, stage: int) -> tuple[tuple, StageArrays]:
        """The cache key and DP arrays of stage ``stage`` of ``task`` (objective: seconds per iteration).

        The stage's layers are its model chunks one after another (several runs when interleaved). The first layer
        of a chunk that receives from another chunk pays the backward p2p, the last layer of a chunk that sends to
        another pays the forward p2p; between two chunks of the stage there is no transition (they are not
        neighbours in the model), so the DP's transition there is free."""
        key, (intra, memory, blocks, block) = self.stage_parts(task, stage)
        hit = self._problems.get(key)
        if hit is None:
            hit = self._problems[key] = (intra, memory, blocks[np.asarray(block, dtype=np.intp)])
        return key, hit

    def stage_parts(self, task: Task, stage: int) -> tuple[tuple, StageParts]:
        """:meth:`stage_problem` with the transitions as their distinct ``[S][S]`` blocks and each layer's block
        (what the C++ core takes: the layers of a type share one block, so no ``[L][S][S]`` tensor is built)."""
        c, pp = task.micro_batches, task.pp
        layers = self.tasks.layers
        indices = layers.stage_layers(task.division, pp)[stage]
        starts = layers.stage_chunk_starts(task.division, pp)[stage]
        types = tuple(layers.type_of[i] for i in indices)
        ends = tuple(layers.type_ends[i] for i in indices)
        in_flight = self.tasks.in_flight(task)[stage]
        last_layer = len(layers) - 1
        breaks = tuple(pos for pos in starts if pos > 0)  # a chunk of this stage begins after another one ends
        recv = tuple(pos for pos in starts if indices[pos] > 0)  # chunk starts fed by another chunk
        chunk_ends = [pos - 1 for pos in starts[1:]] + [len(indices) - 1]
        send = tuple(pos for pos in chunk_ends if indices[pos] < last_layer)  # chunk ends feeding another chunk
        embedding = indices[0] == 0
        head = indices[-1] == last_layer
        # the first stage receives from the embedding, the last one sends to the head: their layouts matter there
        vocab = (task.vocab.tp, task.vocab.sp) if embedding or head else None
        key = (pp, task.micro_batch, c, in_flight, types, ends, recv, send, breaks, embedding, head, vocab)
        hit = self._parts.get(key)
        if hit is not None:
            return key, hit
        tables = task.tables
        L, S = len(types), len(tables.candidates)
        from_embedding, to_head = tables.vocab_boundaries(self.cost, task.vocab, task.micro_batch)
        intra = np.empty((L, S))
        memory = np.empty((L, S))
        transient = np.empty((L, S))
        blocks = [np.zeros((S, S))]  # block 0: no transition (layer 0, and between two chunks of the stage)
        block = [0] * L
        # per layer type and its count in the layer's chunk: what every such layer repeats (the stage's layers are
        # mostly of one type); a ddp layer's sync is its share of the buckets of its chunk's layers of its type
        chunk_of = np.searchsorted(starts, np.arange(L), side="right") - 1
        count = Counter(zip(chunk_of.tolist(), types))
        rows: dict[tuple[int, int], np.ndarray] = {}
        kept: dict[int, np.ndarray] = {}
        block_of_type: dict[int, int] = {}
        for pos, t in enumerate(types):
            terms = tables.terms[t]
            n = count[(int(chunk_of[pos]), t)]
            if (t, n) not in rows:
                row = c * terms.micro_batch_s + tables.sync_share(self.cost, t, n)
                if len(terms.regather_s):  # ZeRO-2's all-gather before every micro-batch but the one priced
                    row = row + (c - 1) * terms.regather_s
                if len(terms.step_s):
                    row = row + terms.step_s  # once per iteration: a ZeRO layer's sharded optimizer step
                rows[(t, n)] = row
            if t not in kept:
                kept[t] = terms.memory_mib(in_flight)
            row = rows[(t, n)]
            if pos in recv:
                row = row + c * terms.p2p_s  # backward gradient sent to the previous chunk's stage
            if pos in send:
                row = row + c * terms.p2p_s  # forward activation sent to the next chunk's stage
            if pos == 0 and embedding:
                row = row + c * from_embedding  # re-shard the embedding's output into this layer's layout
            if pos == L - 1 and head:
                row = row + c * to_head  # re-shard this layer's output into the head's layout
            allowed = tables.allowed_at_end[t] if ends[pos] else tables.allowed[t]
            intra[pos] = np.where(allowed, row, np.inf)  # +inf: a form the model cannot run
            memory[pos] = kept[t]
            transient[pos] = terms.transient_mib
            if pos > 0 and pos not in breaks:
                if t not in block_of_type:
                    block_of_type[t] = len(blocks)
                    blocks.append(c * tables.redistribution[t] + tables.penalty[t])
                block[pos] = block_of_type[t]
        parts = self._parts[key] = (intra, memory, np.stack(blocks), tuple(block))
        self._transients[key] = transient
        return key, parts

    def levels(self, key: tuple, arrays: StageArrays, budget: float) -> list[Level]:
        """One ``(key, budget, arrays, columns)`` problem per transient level of the stage (see the module docstring),
        each reduced to the candidates ``columns`` that can matter there (:func:`undominated`); a level none of whose
        remaining candidates reaches its transient is left out (a lower level holds the same plans with more memory)."""
        intra, memory, inter = arrays
        transient = self._transients[key]
        values = np.unique(transient[np.isfinite(intra)])
        if len(values) <= 1:
            tau = float(values[0]) if len(values) else 0.0
            return [(key, budget - tau, *self._reduced(key, arrays, intra))]
        out: list[Level] = []
        uniform = bool((transient == transient[:1]).all()) if len(transient) else True
        if uniform:  # a candidate is allowed at every layer or at none: the whole stage's verdicts hold at each level
            whole = self._beats(key, arrays, intra)
            runs = np.isfinite(intra).any(axis=0)
            priced = _priced(intra, memory)
            for tau in values:
                keep = (transient[0] <= tau) & runs
                keep &= ~(whole & keep[:, None]).any(axis=0)
                columns = np.flatnonzero(keep)
                if not len(columns) or transient[0, columns].max() < tau:
                    continue  # every plan of this level is a plan of a lower level, whose budget is larger
                level_key, level_budget = (*key, "tau", float(tau)), budget - float(tau)
                self._bounds[(level_key, level_budget)] = _bound(priced[:, :, columns], level_budget)
                out.append((level_key, level_budget, _Lazy(intra, memory, inter, columns), columns))
            return out
        for tau in values:
            masked = np.where(transient <= tau, intra, np.inf)
            reduced, columns = self._reduced(key, arrays, masked)
            if transient[:, columns][np.isfinite(reduced[0])].max(initial=-np.inf) < tau:
                continue  # every plan of this level is a plan of a lower level, whose budget is larger
            out.append(((*key, "tau", float(tau)), budget - float(tau), reduced, columns))
        return out

    def _levels_of(self, key: tuple, arrays: StageArrays, budget: float) -> list[Level]:
        hit = self._levels.get((key, budget))
        if hit is None:
            hit = self._levels[(key, budget)] = self.levels(key, arrays, budget)
        return hit

    def _classes_of(self, key: tuple, inter: np.ndarray) -> np.ndarray:
        classes = self._classes.get(key)
        if classes is None:
            classes = self._classes[key] = transition_classes(inter)
        return classes

    def _beats(self, key: tuple, arrays: StageArrays, intra: np.ndarray) -> np.ndarray:
        return undominated_beats(intra, arrays[1], self._classes_of(key, arrays[2]))

    def _reduced(self, key: tuple, arrays: StageArrays, intra: np.ndarray) -> tuple[StageArrays, np.ndarray]:
        memory, inter = arrays[1], arrays[2]
        beats = self._beats(key, arrays, intra)
        keep = (np.isfinite(intra) & np.isfinite(memory)).any(axis=0) & ~beats.any(axis=0)
        columns = _columns(keep)
        return (intra[:, columns], memory[:, columns], inter[:, columns[:, None], columns]), columns

    def _cached(self, key: tuple, budget: float) -> tuple[bool, dp_core.StageSolution | None]:
        for solved_budget, solution in self._solutions.get(key, ()):
            if solution is None and solved_budget >= budget:
                return True, None
            if solution is not None and solved_budget >= budget and solution.memory_mib <= budget:
                return True, solution
            if solved_budget == budget:
                return True, solution
        return False, None

    def solve(self, wave: Sequence[Task]) -> list[Solutions]:
        """Every stage of every task of ``wave``, by the C++ core's levels (:func:`galva_search.dp.solve_stages`), or
        where it is not built by the same rules in Python (:meth:`solve_python`)."""
        if not dp_core.has_cpp():
            return self.solve_python(wave)
        items = []
        for task in wave:
            for stage, budget in enumerate(self.tasks.stage_budgets(task)):
                key, parts = self.stage_parts(task, stage)
                items.append((self._stage_levels(key, parts), budget))
        solutions, solved, reused = dp_core.solve_stages(items, threads=self.threads)
        self.counts["dp_problems"] += solved
        self.counts["dp_reused"] += reused
        out, n = [], 0
        for task in wave:
            out.append(solutions[n : n + task.pp])
            n += task.pp
        return out

    def _stage_levels(self, key: tuple, parts: StageParts) -> dp_core.StageLevels:
        hit = self._core_levels.get(key)
        if hit is None:
            intra, memory, blocks, block = parts
            hit = self._core_levels[key] = dp_core.StageLevels(intra, memory, blocks, self._transients[key], block)
        return hit

    def solve_python(self, wave: Sequence[Task]) -> list[Solutions]:
        """:meth:`solve` in Python: new problems in rounds of :func:`galva_search.dp.solve_many` calls."""
        # Per stage, its levels in order of a lower bound on their time; rounds of one solve_many call each solve the
        # next level of every stage until no level left can beat the stage's best (the fastest, the lowest level of
        # equal ones: the order the levels alone would give).
        stages: list[_Levels] = []
        for task in wave:
            for stage, budget in enumerate(self.tasks.stage_budgets(task)):
                key, arrays = self.stage_problem(task, stage)
                levels = self._levels_of(key, arrays, budget)
                known = self._bounds
                bounds = [known[lv[:2]] if lv[:2] in known else level_bound(lv) for lv in levels]
                order = sorted(range(len(levels)), key=lambda i: (bounds[i], i))
                stages.append(_Levels(levels, order, bounds))
        while True:
            pending: dict[tuple, Level] = {}
            for st in stages:
                while st.next < len(st.order):
                    i = st.order[st.next]
                    if st.bounds[i] > st.best_time + 1e-9 * abs(st.best_time):  # this level and the rest cannot win
                        st.next = len(st.order)
                        break
                    found, sol = self._cached(st.levels[i][0], st.levels[i][1])
                    if not found:
                        pending.setdefault(st.levels[i][:2], st.levels[i])
                        break
                    self.counts["dp_reused"] += 1
                    st.next += 1
                    if sol is not None and (sol.time < st.best_time or (sol.time == st.best_time and i < st.best)):
                        st.best_time, st.best = sol.time, i
            if not pending:
                break
            items = list(pending.values())
            problems = [dp_core.StageProblem(a[0], a[1], a[2], budget) for _, budget, a, _ in items]
            self.counts["dp_problems"] += len(problems)
            solutions = dp_core.solve_many(problems, threads=self.threads)
            for (key, budget, _, columns), sol in zip(items, solutions):
                self._solutions.setdefault(key, []).append((budget, expand(sol, columns)))
        out = []
        n = 0
        for task in wave:
            per_stage = []
            for _ in range(task.pp):
                st = stages[n]
                n += 1
                per_stage.append(None if st.best < 0 else self._cached(*st.levels[st.best][:2])[1])
            out.append(per_stage)
        return out

    def solve_after(
        self, task: Task, stage: int, previous: int | dict[int, int]
    ) -> dp_core.StageSolution | None:
        """Stage ``stage`` re-solved knowing the candidate that the layer before each of its chunks runs (``previous``:
        position in the stage -> candidate; an int is the candidate before position 0): each such first layer then
        pays the exact re-sharding from that layout and the backward p2p in it (a constant, left out) instead of the
        p2p in its own layout that :meth:`stage_problem` assumes."""
        key, (intra, memory, blocks, block) = self.stage_parts(task, stage)
        before = {0: previous} if isinstance(previous, int) else previous
        types = self.tasks.layers.stage_types(task.division, task.pp)[stage]
        c = task.micro_batches
        intra = intra.copy()
        for pos, cand in before.items():
            t = types[pos]
            intra[pos] += c * (task.tables.redistribution[t][cand] - task.tables.terms[t].p2p_s)
        best: dp_core.StageSolution | None = None
        stage_budget = self.tasks.stage_budgets(task)[stage]
        if dp_core.has_cpp():  # the same levels, solved until none left can win (the fastest; the lowest of equals)
            levels = dp_core.StageLevels(intra, memory, blocks, self._transients[key], block)
            (best,), solved, _ = dp_core.solve_stages([(levels, stage_budget)], threads=1)
            self.counts["dp_problems"] += solved
            return best
        inter = self.stage_problem(task, stage)[1][2]
        for _, budget, arrays, columns in self.levels(key, (intra, memory, inter), stage_budget):
            self.counts["dp_problems"] += 1
            sol = expand(dp_core.solve_stage(arrays[0], arrays[1], arrays[2], budget), columns)
            if sol is not None and (best is None or sol.time < best.time):
                best = sol
        return best

    def solve_uniform(self, task: Task, time_of: Callable[[Task, list[tuple[int, ...]]], float]) -> Solutions:
        """One candidate for every layer: the one of least ``time_of`` (iteration seconds) that fits every stage."""
        budgets = self.tasks.stage_budgets(task)
        best: tuple[float, list[dp_core.StageSolution]] | None = None
        problems = [self.stage_parts(task, stage) for stage in range(task.pp)]
        for s in range(len(task.tables.candidates)):
            sols = []
            for (key, (intra, memory, _, _)), budget in zip(problems, budgets):
                mem = float(memory[:, s].sum() + self._transients[key][:, s].max())
                if mem > budget or not np.isfinite(intra[:, s]).all():  # too big, or refused by the model
                    break
                sols.append(dp_core.StageSolution((s,) * intra.shape[0], float(intra[:, s].sum()), mem))
            else:
                t = time_of(task, [sol.choice for sol in sols])
                if best is None or t < best[0]:
                    best = (t, sols)
        return list(best[1]) if best is not None else [None] * task.pp


def transition_classes(inter: np.ndarray) -> np.ndarray:
    """Per candidate, a class number shared by exactly the candidates with the same transitions from and to every
    candidate at every layer (candidates that differ only in what the layer itself costs, e.g. expert layouts)."""
    S = inter.shape[1]
    seen: dict[bytes, int] = {}
    out = np.empty(S, dtype=int)
    for s in range(S):
        out[s] = seen.setdefault(inter[:, :, s].tobytes() + inter[:, s, :].tobytes(), len(seen))
    return out


def undominated_beats(intra: np.ndarray, memory: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """``[S][S]``: candidate ``a`` beats ``b`` when both are of one transition class and ``a`` matches or beats ``b``
    in time and memory at every layer where ``b`` may run (of equal ones the first beats the others).

    A beaten candidate can be dropped from the stage problem: swapping it for its beater (or for the one that beats
    that, and so on: the relation is a strict order) in any plan keeps every transition, is no slower and uses no
    more memory, so the optimum is unchanged (exact). This is what keeps the expert layouts, which change only a
    layer's own costs, from multiplying the DP's work."""
    live = np.isfinite(intra) & np.isfinite(memory)
    t = np.where(live, intra, np.inf)
    m = np.where(live, memory, np.inf)
    le = ((t[:, :, None] <= t[:, None, :]) & (m[:, :, None] <= m[:, None, :])).all(axis=0)
    eq = ((t[:, :, None] == t[:, None, :]) & (m[:, :, None] == m[:, None, :])).all(axis=0)
    order = np.arange(len(classes))
    beats = le & (~eq | (order[:, None] < order[None, :])) & (classes[:, None] == classes[None, :])
    beats &= live.any(axis=0)[:, None]  # a candidate no layer may run beats nothing
    np.fill_diagonal(beats, False)
    return beats


def level_bound(level: Level) -> float:
    """A lower bound on the time of a level's plans: ``max_lam min (time + lam (memory - budget))`` with the layers
    chosen apart (transitions cost >= 0), over a range of multipliers ``lam`` (seconds per MiB)."""
    _, budget, (intra, memory, _), _ = level
    return _bound(_priced(intra, memory), budget)


def _priced(intra: np.ndarray, memory: np.ndarray) -> np.ndarray:
    """``[lam][L][S]``: time plus ``lam`` times memory of every candidate that may run there (+inf elsewhere)."""
    live = np.isfinite(intra) & np.isfinite(memory)
    with np.errstate(invalid="ignore"):
        return np.where(live[None], intra[None] + BOUND_LAMBDAS[:, None, None] * memory[None], np.inf)


def _bound(priced: np.ndarray, budget: float) -> float:
    if priced.shape[2] == 0:
        return math.inf
    with np.errstate(invalid="ignore"):
        return float((priced.min(axis=2).sum(axis=1) - BOUND_LAMBDAS * budget).max())


BOUND_LAMBDAS = np.concatenate([[0.0], np.logspace(-9, 1, 41)])


class _Lazy:
    """A level's reduced arrays, built when first read (most levels of a stage are never solved)."""

    def __init__(self, intra: np.ndarray, memory: np.ndarray, inter: np.ndarray, columns: np.ndarray) -> None:
        self._source = (intra, memory, inter, columns)
        self._arrays: StageArrays | None = None

    def __getitem__(self, i: int) -> np.ndarray:
        if self._arrays is None:
            intra, memory, inter, c = self._source
            self._arrays = (intra[:, c], memory[:, c], inter[:, c[:, None], c])
        return self._arrays[i]

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter((self[0], self[1], self[2]))


def _columns(keep: np.ndarray) -> np.ndarray:
    columns = np.flatnonzero(keep)
    return columns if len(columns) else np.arange(min(1, len(keep)))  # none: one forbidden column says so


def expand(solution: dp_core.StageSolution | None, columns: np.ndarray) -> dp_core.StageSolution | None:
    """A reduced problem's solution in the stage problem's candidate numbers."""
    if solution is None:
        return None
    return dp_core.StageSolution(tuple(int(columns[s]) for s in solution.choice), solution.time, solution.memory_mib)
