"""Per-stage strategy DP: pick one strategy per layer, minimising time under a memory budget.

Given, for the layers of one pipeline stage, ``intra_time[l][s]`` (time of layer ``l`` under strategy ``s``),
``memory_mib[l][s]`` and ``inter_time[l][i][j]`` (cost of going from strategy ``i`` at layer ``l-1`` to ``j`` at
layer ``l``; layer 0's block is ignored), :func:`solve_stage` returns the plan minimising
``Σ intra + Σ inter`` subject to ``Σ memory <= budget_mib``, or ``None`` when no plan fits.

Inputs are lists or numpy arrays of numbers ``>= 0``; ``+inf`` marks a forbidden choice or transition; NaN, negative
values and wrong shapes raise ``ValueError`` naming the array and index. A negative budget is simply infeasible.

Backends: ``"cpp"`` (the exact C++ core in ``_core``, see ``cpp/stage_dp.hpp`` for the algorithm and its optimality
argument), ``"python"`` (a pure-Python twin of the same Pareto-front recurrence, without the C++ pruning, used to
cross-check it) and ``"auto"`` (cpp when the extension imports). :func:`brute_force` enumerates every plan, for tests.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

_core: ModuleType | None
try:
    from galva_search import _core
except ImportError:  # pragma: no cover - a source checkout without the built extension
    _core = None

Backend = Literal["auto", "cpp", "python"]
Matrix = Any  # Sequence[Sequence[float]] or a 2-d numpy array
Tensor3 = Any  # Sequence[Sequence[Sequence[float]]] or a 3-d numpy array


@dataclass(frozen=True)
class StageSolution:
    """Optimal plan of one stage: ``choice[l]`` is the strategy index of layer ``l``.

    ``time`` and ``memory_mib`` are the plan's cost recomputed from the inputs, summed layer by layer.
    """

    choice: tuple[int, ...]
    time: float
    memory_mib: float


@dataclass(frozen=True)
class _Flat:
    layers: int
    strategies: int
    intra: array
    memory: array
    inter: array
    budget: float

    def as_core_args(self) -> tuple[int, int, Any, Any, Any, float]:
        return (self.layers, self.strategies, self.intra, self.memory, self.inter, self.budget)


@dataclass(frozen=True)
class StageProblem:
    """One stage's inputs (same meaning as :func:`solve_stage`'s arguments); shapes are checked on construction."""

    intra_time: Matrix
    memory_mib: Matrix
    inter_time: Tensor3
    budget_mib: float
    _flat: _Flat = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_flat", _flatten(self.intra_time, self.memory_mib, self.inter_time, self.budget_mib))


def has_cpp() -> bool:
    """Whether the C++ extension imported."""
    return _core is not None


def solve_stage(
    intra_time: Matrix,
    memory_mib: Matrix,
    inter_time: Tensor3,
    budget_mib: float,
    *,
    backend: Backend = "auto",
    memory_resolution_mib: float = 0.0,
    prune_strategies: bool = True,
    use_bounds: bool = True,
    stats: dict[str, Any] | None = None,
) -> StageSolution | None:
    """Fastest plan of one stage within ``budget_mib``, or ``None`` if none fits.

    ``memory_resolution_mib > 0`` rounds every memory value UP to that grid before solving (smaller search, and every
    returned plan still truly fits; it may miss plans that fit only without rounding). ``prune_strategies`` and
    ``use_bounds`` switch the C++ core's dominance pruning and Lagrangian bounds (on by default; off only to test the
    bare recurrence). ``stats``, if given, receives the C++ core's counters (method, front_points, max_front, ...).
    """
    flat = _flatten(intra_time, memory_mib, inter_time, budget_mib)
    return _solve_flat(flat, _pick(backend), memory_resolution_mib, prune_strategies, use_bounds, stats)


def solve_many(
    problems: Sequence[StageProblem],
    *,
    threads: int = 0,
    backend: Backend = "auto",
    memory_resolution_mib: float = 0.0,
    prune_strategies: bool = True,
    use_bounds: bool = True,
) -> list[StageSolution | None]:
    """Solve independent stages; the C++ backend runs them on ``threads`` threads (0 = all) with the GIL released."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    for i, p in enumerate(problems):
        if not isinstance(p, StageProblem):
            raise ValueError(f"problems[{i}] is a {type(p).__name__}, expected a StageProblem")
    _check_resolution(memory_resolution_mib)
    chosen = _pick(backend)
    if chosen == "python":
        out = []
        for i, p in enumerate(problems):
            try:
                out.append(_solve_flat(p._flat, "python", memory_resolution_mib, True, True, None))
            except ValueError as e:
                raise ValueError(f"problems[{i}]: {e}") from None
        return out
    raw = _extension().solve_many(
        [p._flat.as_core_args() for p in problems], threads, memory_resolution_mib, prune_strategies, use_bounds
    )
    return [_to_solution(r) for r in raw]


class StageLevels:
    """One stage's transient levels in the C++ core (``cpp/stage_levels.hpp``): reduced to the candidates that can
    matter, bounded, solved on demand and their solutions kept for the next task that asks. ``transient_mib``
    ``[L][S]``: what each candidate holds while its layer runs (the level rules are in :mod:`galva_search.stages`)."""

    def __init__(
        self,
        intra_time: Matrix,
        memory_mib: Matrix,
        inter_time: Tensor3,
        transient_mib: Matrix,
        block: Sequence[int] | None = None,
    ) -> None:
        """``block`` (one index per layer): ``inter_time`` holds only the distinct ``[S][S]`` transition blocks and
        layer ``l``'s is ``inter_time[block[l]]`` (layers of one type share theirs: no ``[L][S][S]`` tensor)."""
        if block is None:
            flat = _flatten(intra_time, memory_mib, inter_time, 0.0)
            inter = flat.inter
        else:
            flat = _flatten(intra_time, memory_mib, [], 0.0, check_inter=False)
            blocks = len(inter_time)
            inter = _flatten_one(inter_time, "inter_time", (blocks, flat.strategies, flat.strategies))
            block = [int(b) for b in block]
            if len(block) != flat.layers or any(not 0 <= b < blocks for b in block):
                raise ValueError(f"block must hold {flat.layers} indices into the {blocks} blocks of inter_time")
        transient = _flatten_one(transient_mib, "transient_mib", (flat.layers, flat.strategies))
        self.core = _extension().StageLevels(
            flat.layers, flat.strategies, flat.intra, flat.memory, inter, transient, block or []
        )

    @property
    def levels(self) -> list[tuple[float, tuple[int, ...]]]:
        """``(tau, kept candidates)`` of every level, in order of tau."""
        return list(self.core.levels)


def solve_stages(
    stages: Sequence[tuple[StageLevels, float]], *, threads: int = 0, cutoffs: bool = True
) -> tuple[list[StageSolution | None], int, int]:
    """The best plan of each ``(stage levels, stage budget)`` over its levels (the fastest, the lowest level of equal
    ones; None: nothing fits), the levels of all stages solved in rounds on ``threads`` C++ threads (0 = all), and
    the number of DPs run and of level solutions reused. ``cutoffs``: each level's DP is told the best time its stages
    already have and may stop once it cannot reach it (the same optimum, less work; off only to test that)."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    raw, solved, reused = _extension().solve_stages([(s.core, float(b)) for s, b in stages], threads, cutoffs)
    return [_to_solution(r) for r in raw], int(solved), int(reused)


def plan_cost(
    intra_time: Matrix, memory_mib: Matrix, inter_time: Tensor3, choice: Sequence[int]
) -> tuple[float, float]:
    """(time, memory) of a plan, summed layer by layer in the same order as the solvers."""
    time = 0.0
    memory = 0.0
    for layer, s in enumerate(choice):
        if layer > 0:
            time += float(inter_time[layer][choice[layer - 1]][s])
        time += float(intra_time[layer][s])
        memory += float(memory_mib[layer][s])
    return time, memory


def brute_force(intra_time: Matrix, memory_mib: Matrix, inter_time: Tensor3, budget_mib: float) -> StageSolution | None:
    """Enumerate all S**L plans (tests only). Ties go to the lexicographically smallest plan."""
    flat = _flatten(intra_time, memory_mib, inter_time, budget_mib)
    _check_values(flat)
    best: StageSolution | None = None
    for choice in itertools.product(range(flat.strategies), repeat=flat.layers):
        time, memory = plan_cost(intra_time, memory_mib, inter_time, choice)
        if memory <= budget_mib and math.isfinite(time) and (best is None or time < best.time):
            best = StageSolution(tuple(choice), time, memory)
    return best


# ----------------------------------------------------------------------------------------------------------------
# Input handling


def _pick(backend: str) -> str:
    if backend == "auto":
        return "cpp" if _core is not None else "python"
    if backend == "cpp":
        if _core is None:
            raise ValueError("backend='cpp' but the C++ extension galva_search._core did not import")
        return "cpp"
    if backend == "python":
        return "python"
    raise ValueError(f"backend must be 'auto', 'cpp' or 'python', got {backend!r}")


def _check_resolution(r: float) -> None:
    if not (r >= 0 and math.isfinite(r)):
        raise ValueError(f"memory_resolution_mib must be a finite number >= 0, got {r}")


def _is_numpy(x: Any) -> bool:
    return hasattr(x, "__array_interface__") and hasattr(x, "shape")


def _flatten_numpy(x: Any, name: str, shape: tuple[int, ...]) -> array | Any:
    import numpy as np  # only reached when the caller passed a numpy array

    a = np.asarray(x)
    if a.shape != shape:
        raise ValueError(f"{name} has shape {a.shape}, expected {shape}")
    return np.ascontiguousarray(a, dtype=np.float64).reshape(-1)


def _flatten_nested(x: Any, name: str, shape: tuple[int, ...]) -> array:
    out = array("d")

    def walk(node: Any, depth: int, where: str) -> None:
        try:
            n = len(node)
        except TypeError:
            raise ValueError(f"{name}{where} is not a sequence (expected shape {shape})") from None
        if n != shape[depth]:
            raise ValueError(f"{name}{where} has length {n}, expected {shape[depth]} (expected shape {shape})")
        if depth == len(shape) - 1:
            try:
                out.extend(float(v) for v in node)
            except (TypeError, ValueError):
                raise ValueError(f"{name}{where} holds a non-number") from None
            return
        for i, child in enumerate(node):
            walk(child, depth + 1, f"{where}[{i}]")

    walk(x, 0, "")
    return out


def _flatten_one(x: Any, name: str, shape: tuple[int, ...]) -> Any:
    return _flatten_numpy(x, name, shape) if _is_numpy(x) else _flatten_nested(x, name, shape)


def _flatten(
    intra_time: Matrix, memory_mib: Matrix, inter_time: Tensor3, budget_mib: float, *, check_inter: bool = True
) -> _Flat:
    try:
        layers = len(intra_time)
    except TypeError:
        raise ValueError("intra_time must be a [layers][strategies] array") from None
    strategies = len(intra_time[0]) if layers else 0
    if layers and strategies == 0:
        raise ValueError("intra_time[0] is empty: every layer needs at least one strategy")
    try:
        budget = float(budget_mib)
    except (TypeError, ValueError):
        raise ValueError(f"budget_mib must be a number, got {budget_mib!r}") from None
    if math.isnan(budget):
        raise ValueError("budget_mib is NaN")
    return _Flat(
        layers,
        strategies,
        _flatten_one(intra_time, "intra_time", (layers, strategies)),
        _flatten_one(memory_mib, "memory_mib", (layers, strategies)),
        _flatten_one(inter_time, "inter_time", (layers, strategies, strategies)) if check_inter else array("d"),
        budget,
    )


def _check_values(f: _Flat) -> None:
    """Same rule and message as the C++ core's validate()."""
    L, S = f.layers, f.strategies
    for name, data, start in (("intra_time", f.intra, 0), ("memory_mib", f.memory, 0), ("inter_time", f.inter, S * S)):
        for k in range(start, len(data)):
            v = float(data[k])
            if math.isnan(v) or v < 0:
                if name == "inter_time":
                    where = f"[{k // (S * S)}][{k // S % S}][{k % S}]"
                else:
                    where = f"[{k // S}][{k % S}]"
                kind = "NaN" if math.isnan(v) else "negative"
                raise ValueError(
                    f"{name}{where} = {v!r}: costs and memory must be >= 0 (+inf marks a forbidden choice), not {kind}"
                )
    del L


def _to_solution(raw: Any) -> StageSolution | None:
    if raw is None:
        return None
    choice, time, memory = raw
    return StageSolution(tuple(int(c) for c in choice), float(time), float(memory))


def _extension() -> ModuleType:
    if _core is None:
        raise RuntimeError("galva-search's C++ core is not built: reinstall the package (pip install galva-search)")
    return _core


def _solve_flat(
    f: _Flat, backend: str, resolution: float, prune: bool, bounds: bool, stats: dict[str, Any] | None
) -> StageSolution | None:
    _check_resolution(resolution)
    if backend == "cpp":
        raw, st = _extension().solve_stage(*f.as_core_args(), resolution, prune, bounds)
        if stats is not None:
            stats.update(st)
        return _to_solution(raw)
    _check_values(f)
    return _pareto_python(f, resolution)


# ----------------------------------------------------------------------------------------------------------------
# Pure-Python twin: the Pareto-front recurrence of stage_dp.hpp step 3, without dominance pruning or bounds.


def _round_up(v: float, r: float) -> float:
    if r <= 0 or not math.isfinite(v):
        return v
    g = math.ceil(v / r) * r
    while g < v:
        g += r
    return g


def _pareto_python(f: _Flat, resolution: float) -> StageSolution | None:
    L, S = f.layers, f.strategies
    if L == 0:
        return StageSolution((), 0.0, 0.0) if f.budget >= 0 else None
    intra = [list(f.intra[i * S : (i + 1) * S]) for i in range(L)]
    mem = [[_round_up(float(v), resolution) for v in f.memory[i * S : (i + 1) * S]] for i in range(L)]
    inter = f.inter
    # smallest memory layers l.. can still use (for early feasibility cut-off)
    suffix = [0.0] * (L + 1)
    for layer in range(L - 1, -1, -1):
        usable = [mem[layer][s] for s in range(S) if math.isfinite(intra[layer][s])]
        suffix[layer] = (min(usable) if usable else math.inf) + suffix[layer + 1]
    slack = 1e-12 * (abs(f.budget) + 1.0)

    # fronts[l][j] = list of (memory, time, prev_strategy, prev_index), memory ascending, time strictly descending
    fronts: list[list[list[tuple[float, float, int, int]]]] = []
    first = []
    for j in range(S):
        m, t = mem[0][j], intra[0][j]
        ok = math.isfinite(m) and math.isfinite(t) and m + suffix[1] <= f.budget + (slack if L > 1 else 0.0)
        first.append([(m, t, -1, -1)] if ok else [])
    fronts.append(first)
    for layer in range(1, L):
        limit = f.budget + (slack if layer < L - 1 else 0.0) - suffix[layer + 1]
        merged = sorted(
            (pt[0], pt[1], i, q) for i, front in enumerate(fronts[-1]) for q, pt in enumerate(front)
        )
        base = layer * S * S
        level = []
        for j in range(S):
            out: list[tuple[float, float, int, int]] = []
            mj, tj = mem[layer][j], intra[layer][j]
            if math.isfinite(mj) and math.isfinite(tj):
                best = math.inf
                for m0, t0, i, q in merged:
                    m = m0 + mj
                    if m > limit:
                        break
                    t = t0 + inter[base + i * S + j] + tj
                    if t < best:
                        best = t
                        if out and out[-1][0] == m:
                            out[-1] = (m, t, i, q)
                        else:
                            out.append((m, t, i, q))
            level.append(out)
        fronts.append(level)
    best_t, best_j, best_q = math.inf, -1, -1
    for j, front in enumerate(fronts[-1]):
        for q, (m, t, _, _) in enumerate(front):
            if t < best_t and m <= f.budget:
                best_t, best_j, best_q = t, j, q
    if best_j < 0:
        return None
    choice = [0] * L
    j, q = best_j, best_q
    for layer in range(L - 1, -1, -1):
        choice[layer] = j
        _, _, j, q = fronts[layer][j][q]
    time, memory = 0.0, 0.0
    for layer, s in enumerate(choice):
        if layer > 0:
            time += inter[layer * S * S + choice[layer - 1] * S + s]
        time += intra[layer][s]
        memory += float(f.memory[layer * S + s])
    return StageSolution(tuple(choice), time, memory)
