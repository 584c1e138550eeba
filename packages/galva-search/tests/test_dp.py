"""The per-stage DP: C++ core == pure-Python twin == brute force, plus edge cases and input errors."""

from __future__ import annotations

import math
import random

import pytest

from galva_search import dp

needs_cpp = pytest.mark.skipif(not dp.has_cpp(), reason="C++ extension galva_search._core not built")


def random_instance(rng: random.Random, layers: int, strategies: int, *, ties: bool = False, forbid: bool = False):
    """Random stage; `ties` uses small integers so equal costs and memory sums are common."""
    if ties:
        intra = [[float(rng.randint(1, 4)) for _ in range(strategies)] for _ in range(layers)]
        mem = [[float(rng.randint(0, 4)) for _ in range(strategies)] for _ in range(layers)]
        inter = [[[float(rng.choice([0, 0, 1])) for _ in range(strategies)] for _ in range(strategies)]
                 for _ in range(layers)]
    else:
        intra = [[rng.uniform(0.5, 2.0) for _ in range(strategies)] for _ in range(layers)]
        mem = [[rng.uniform(0.0, 10.0) for _ in range(strategies)] for _ in range(layers)]
        inter = [[[0.0 if i == j else rng.uniform(0.0, 0.5) for j in range(strategies)] for i in range(strategies)]
                 for _ in range(layers)]
    if forbid:
        for _ in range(max(1, layers * strategies // 6)):
            intra[rng.randrange(layers)][rng.randrange(strategies)] = math.inf
        for _ in range(max(1, layers * strategies // 4)):
            inter[rng.randrange(layers)][rng.randrange(strategies)][rng.randrange(strategies)] = math.inf
    lo = sum(min(row) for row in mem)
    hi = sum(max(row) for row in mem)
    budget = rng.choice([lo - 1.0, lo, rng.uniform(lo, hi), rng.uniform(lo, hi), hi, hi + 5.0])
    if ties:
        budget = float(round(budget))
    return intra, mem, inter, budget


def check_plan(sol: dp.StageSolution, intra, mem, inter, budget) -> None:
    """The returned plan's recomputed cost is what was reported, and it fits."""
    assert len(sol.choice) == len(intra)
    time, memory = dp.plan_cost(intra, mem, inter, sol.choice)
    assert time == sol.time
    assert memory == sol.memory_mib
    assert memory <= budget


def assert_same_optimum(a: dp.StageSolution | None, b: dp.StageSolution | None) -> None:
    assert (a is None) == (b is None), (a, b)
    if a is not None:
        assert a.time == pytest.approx(b.time, rel=1e-9, abs=1e-12)


@needs_cpp
@pytest.mark.parametrize("seed", range(4))
def test_cpp_equals_python_twin_randomised(seed: int) -> None:
    rng = random.Random(1000 + seed)
    infeasible = 0
    for case in range(100):
        layers, strategies = rng.randint(1, 14), rng.randint(1, 9)
        inst = random_instance(rng, layers, strategies, ties=case % 3 == 0, forbid=case % 5 == 0)
        cpp = dp.solve_stage(*inst, backend="cpp")
        py = dp.solve_stage(*inst, backend="python")
        bare = dp.solve_stage(*inst, backend="cpp", prune_strategies=False, use_bounds=False)
        assert_same_optimum(cpp, py)
        assert_same_optimum(bare, py)
        for sol in (cpp, py, bare):
            if sol is not None:
                check_plan(sol, *inst)
        infeasible += cpp is None
    assert 5 <= infeasible <= 60  # the generator covers both outcomes


def homogeneous_instance(rng: random.Random, layers: int, strategies: int, *, ties: bool):
    """All layers share one cost row and one transition matrix (one layer type), as in real models: exercises the
    reuse of dominance verdicts and transition tables across identical layers."""
    intra, mem, inter, _ = random_instance(rng, 1, strategies, ties=ties)
    if not ties:  # cheap, mostly-zero transitions with tie-breakers, like the reference's
        inter = [[[0.0 if i == j else rng.choice([0.0, 0.0, 1e-9, 2e-9, 0.05]) for j in range(strategies)]
                  for i in range(strategies)]]
    lo, hi = layers * min(mem[0]), layers * max(mem[0])
    budget = rng.choice([lo, rng.uniform(lo, hi), rng.uniform(lo, hi), hi])
    return intra * layers, mem * layers, inter * layers, float(round(budget)) if ties else budget


@needs_cpp
@pytest.mark.parametrize("ties", [False, True])
def test_homogeneous_layers_cpp_equals_twin(ties: bool) -> None:
    rng = random.Random(77 + ties)
    cross_pruned = 0
    for _ in range(60):
        inst = homogeneous_instance(rng, rng.randint(1, 40), rng.randint(1, 12), ties=ties)
        want = dp.solve_stage(*inst, backend="python")
        for kwargs in ({}, {"use_bounds": False}, {"prune_strategies": False}):
            stats: dict = {}
            got = dp.solve_stage(*inst, backend="cpp", stats=stats, **kwargs)
            cross_pruned += stats.get("cross_pruned", 0)
            assert_same_optimum(got, want)
            if got is not None:
                check_plan(got, *inst)
    assert cross_pruned > 0  # the cross-front dominance step was exercised


@needs_cpp
def test_homogeneous_layers_equal_brute_force() -> None:
    rng = random.Random(99)
    for case in range(30):
        inst = homogeneous_instance(rng, rng.randint(1, 6), rng.randint(1, 7), ties=case % 2 == 0)
        assert_same_optimum(dp.solve_stage(*inst), dp.brute_force(*inst))


@pytest.mark.parametrize("seed", range(3))
def test_dp_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    backends = ["python", "cpp"] if dp.has_cpp() else ["python"]
    for case in range(40):
        layers, strategies = rng.randint(1, 5), rng.randint(1, 6)
        inst = random_instance(rng, layers, strategies, ties=case % 2 == 0, forbid=case % 7 == 0)
        want = dp.brute_force(*inst)
        for backend in backends:
            got = dp.solve_stage(*inst, backend=backend)
            assert_same_optimum(got, want)
            if got is not None:
                check_plan(got, *inst)


@pytest.mark.parametrize("ties", [False, True])
def test_dp_equals_brute_force_6_layers_8_strategies(ties: bool) -> None:
    rng = random.Random(7 + ties)
    for _ in range(2):
        intra, mem, inter, _ = random_instance(rng, 6, 8, ties=ties)
        lo, hi = sum(min(r) for r in mem), sum(max(r) for r in mem)
        budget = float(round(lo + 0.4 * (hi - lo)))
        want = dp.brute_force(intra, mem, inter, budget)
        assert want is not None
        for backend in ["python", "cpp"] if dp.has_cpp() else ["python"]:
            got = dp.solve_stage(intra, mem, inter, budget, backend=backend)
            assert_same_optimum(got, want)
            check_plan(got, intra, mem, inter, budget)


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_solve_many_three_stages_equals_brute_force(backend: str) -> None:
    if backend == "cpp" and not dp.has_cpp():
        pytest.skip("C++ extension not built")
    rng = random.Random(42)
    insts = [random_instance(rng, 5, 6) for _ in range(3)]
    insts[1] = (*insts[1][:3], -1.0)  # one infeasible stage
    problems = [dp.StageProblem(*inst) for inst in insts]
    got = dp.solve_many(problems, threads=3, backend=backend)
    assert len(got) == 3 and got[1] is None
    for sol, inst in zip(got, insts):
        assert_same_optimum(sol, dp.brute_force(*inst))
        if sol is not None:
            check_plan(sol, *inst)


@needs_cpp
def test_solve_many_many_tasks_matches_serial() -> None:
    rng = random.Random(5)
    insts = [random_instance(rng, rng.randint(1, 20), rng.randint(1, 10)) for _ in range(60)]
    problems = [dp.StageProblem(*inst) for inst in insts]
    serial = [dp.solve_stage(*inst) for inst in insts]
    for threads in (0, 1, 4):
        assert dp.solve_many(problems, threads=threads) == serial


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_memory_grid_is_safe(backend: str) -> None:
    """Rounding memory up never returns a plan that does not truly fit, and never beats the exact optimum."""
    if backend == "cpp" and not dp.has_cpp():
        pytest.skip("C++ extension not built")
    rng = random.Random(3)
    for _ in range(60):
        inst = random_instance(rng, rng.randint(1, 8), rng.randint(1, 6))
        exact = dp.solve_stage(*inst, backend=backend)
        grid = dp.solve_stage(*inst, backend=backend, memory_resolution_mib=1.0)
        if grid is not None:
            check_plan(grid, *inst)
            assert exact is not None and grid.time >= exact.time - 1e-12
        if exact is not None and all(float(m).is_integer() for row in inst[1] for m in row):
            assert grid is not None


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_edge_cases(backend: str) -> None:
    if backend == "cpp" and not dp.has_cpp():
        pytest.skip("C++ extension not built")
    solve = lambda *a: dp.solve_stage(*a, backend=backend)  # noqa: E731
    # one layer: the fastest strategy that fits
    assert solve([[3.0, 1.0, 2.0]], [[1.0, 5.0, 2.0]], [[[0.0] * 3] * 3], 2.0) == dp.StageSolution((2,), 2.0, 2.0)
    # one strategy
    assert solve([[1.0]] * 4, [[2.0]] * 4, [[[0.5]]] * 4, 8.0) == dp.StageSolution((0,) * 4, 5.5, 8.0)
    assert solve([[1.0]] * 4, [[2.0]] * 4, [[[0.5]]] * 4, 7.9) is None
    # zero budget: only zero-memory choices
    assert solve([[1.0, 9.0]] * 2, [[1.0, 0.0]] * 2, [[[0.0, 0.0], [0.0, 0.0]]] * 2, 0.0) == dp.StageSolution(
        (1, 1), 18.0, 0.0
    )
    assert solve([[1.0, 9.0]] * 2, [[1.0, 0.5]] * 2, [[[0.0, 0.0], [0.0, 0.0]]] * 2, 0.0) is None
    # negative budget: infeasible, not an error
    assert solve([[1.0]], [[0.0]], [[[0.0]]], -1.0) is None
    # every choice forbidden, or every transition forbidden
    assert solve([[math.inf, math.inf]], [[1.0, 1.0]], [[[0.0] * 2] * 2], 10.0) is None
    assert solve([[1.0, 1.0]] * 2, [[1.0, 1.0]] * 2, [[[math.inf] * 2] * 2] * 2, 10.0) is None
    # infinite budget
    assert solve([[2.0, 1.0]], [[1.0, 1e9]], [[[0.0] * 2] * 2], math.inf) == dp.StageSolution((1,), 1.0, 1e9)
    # no layers
    assert solve([], [], [], 0.0) == dp.StageSolution((), 0.0, 0.0)
    # layer 0's transition block is ignored, even if it holds junk
    assert solve([[1.0]], [[1.0]], [[[math.nan]]], 1.0) == dp.StageSolution((0,), 1.0, 1.0)


def test_transitions_matter() -> None:
    # switching strategy costs more than it saves, so the DP keeps strategy 0 throughout
    intra = [[1.0, 0.9]] * 3
    mem = [[1.0, 1.0]] * 3
    inter = [[[0.0, 0.5], [0.5, 0.0]]] * 3
    for backend in ["cpp", "python"] if dp.has_cpp() else ["python"]:
        got = dp.solve_stage(intra, mem, inter, 3.0, backend=backend)
        assert got is not None and got.time == pytest.approx(2.7) and got.choice == (1, 1, 1)
        inter2 = [[[0.0, 0.5], [0.5, 0.0]], [[0.0, 0.5], [0.5, 0.0]], [[0.0, 0.5], [0.5, 0.0]]]
        intra2 = [[1.0, 0.9], [1.0, 2.0], [1.0, 0.9]]
        got = dp.solve_stage(intra2, mem, inter2, 3.0, backend=backend)
        assert got is not None and got.choice == (0, 0, 0) and got.time == pytest.approx(3.0)


@pytest.mark.parametrize("backend", ["cpp", "python"])
@pytest.mark.parametrize(
    ("array", "index", "bad", "expect"),
    [
        ("intra", (1, 2), math.nan, r"intra_time\[1\]\[2\] = nan.*NaN"),
        ("intra", (0, 0), -1.0, r"intra_time\[0\]\[0\] = -1.*negative"),
        ("mem", (2, 1), -0.5, r"memory_mib\[2\]\[1\] = -0.5.*negative"),
        ("mem", (0, 2), math.nan, r"memory_mib\[0\]\[2\] = nan"),
        ("inter", (2, 0, 1), math.nan, r"inter_time\[2\]\[0\]\[1\] = nan"),
        ("inter", (1, 2, 2), -math.inf, r"inter_time\[1\]\[2\]\[2\] = -inf"),
    ],
)
def test_bad_values_name_array_and_index(backend, array, index, bad, expect) -> None:
    if backend == "cpp" and not dp.has_cpp():
        pytest.skip("C++ extension not built")
    intra = [[1.0] * 3 for _ in range(3)]
    mem = [[1.0] * 3 for _ in range(3)]
    inter = [[[0.0] * 3 for _ in range(3)] for _ in range(3)]
    target = {"intra": intra, "mem": mem, "inter": inter}[array]
    node = target
    for i in index[:-1]:
        node = node[i]
    node[index[-1]] = bad
    with pytest.raises(ValueError, match=expect):
        dp.solve_stage(intra, mem, inter, 10.0, backend=backend)
    if backend == "cpp":
        with pytest.raises(ValueError, match=r"problems\[1\]: " + expect):
            dp.solve_many([dp.StageProblem([[1.0]], [[1.0]], [[[0.0]]], 1.0), dp.StageProblem(intra, mem, inter, 10.0)])


def test_bad_shapes() -> None:
    ok_intra = [[1.0, 1.0]] * 3
    ok_mem = [[1.0, 1.0]] * 3
    ok_inter = [[[0.0, 0.0], [0.0, 0.0]]] * 3
    cases = [
        (([[1.0, 1.0]] * 2, ok_mem, ok_inter), r"memory_mib has length 3, expected 2"),
        ((ok_intra, [[1.0, 1.0], [1.0], [1.0, 1.0]], ok_inter), r"memory_mib\[1\] has length 1, expected 2"),
        ((ok_intra, ok_mem, [[[0.0, 0.0], [0.0, 0.0]]] * 2), r"inter_time has length 2, expected 3"),
        ((ok_intra, ok_mem, [[[0.0, 0.0], [0.0]]] * 3), r"inter_time\[0\]\[1\] has length 1, expected 2"),
        ((ok_intra, ok_mem, [[0.0, 0.0]] * 3), r"inter_time\[0\]\[0\] is not a sequence"),
        (([[], [], []], ok_mem, ok_inter), r"at least one strategy"),
        ((ok_intra, [["a", 1.0]] * 3, ok_inter), r"memory_mib\[0\] holds a non-number"),
    ]
    for args, expect in cases:
        with pytest.raises(ValueError, match=expect):
            dp.solve_stage(*args, 1.0)
        with pytest.raises(ValueError, match=expect):
            dp.StageProblem(*args, 1.0)
    with pytest.raises(ValueError, match="budget_mib is NaN"):
        dp.solve_stage(ok_intra, ok_mem, ok_inter, math.nan)
    with pytest.raises(ValueError, match="backend must be"):
        dp.solve_stage(ok_intra, ok_mem, ok_inter, 1.0, backend="gpu")
    with pytest.raises(ValueError, match="memory_resolution_mib"):
        dp.solve_stage(ok_intra, ok_mem, ok_inter, 1.0, memory_resolution_mib=-1.0)
    with pytest.raises(ValueError, match=r"problems\[0\] is a tuple"):
        dp.solve_many([(ok_intra, ok_mem, ok_inter, 1.0)])


def test_numpy_inputs() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(11)
    intra, mem, inter, budget = random_instance(rng, 7, 5)
    want = dp.solve_stage(intra, mem, inter, budget, backend="python")
    a, m, t = np.array(intra), np.array(mem, dtype=np.float32).astype(np.float64), np.array(inter)
    for backend in ["cpp", "python"] if dp.has_cpp() else ["python"]:
        got = dp.solve_stage(a, m, t, np.float64(budget), backend=backend)
        assert_same_optimum(got, want)
        # non-contiguous / integer arrays are converted
        got2 = dp.solve_stage(np.asfortranarray(a), m, t[:, :, :], budget, backend=backend)
        assert_same_optimum(got2, want)
    with pytest.raises(ValueError, match=r"inter_time has shape \(7, 5, 4\), expected \(7, 5, 5\)"):
        dp.solve_stage(a, m, t[:, :, :4], budget)
    assert dp.solve_many([dp.StageProblem(a, m, t, budget)])[0] == dp.solve_stage(a, m, t, budget)


@needs_cpp
def test_stats_report_the_method() -> None:
    stats: dict = {}
    dp.solve_stage([[1.0, 2.0]] * 3, [[5.0, 1.0]] * 3, [[[0.0] * 2] * 2] * 3, 100.0, stats=stats)
    assert stats["method"] == "unconstrained"
    stats = {}
    dp.solve_stage([[1.0, 2.0]] * 3, [[5.0, 1.0]] * 3, [[[0.0] * 2] * 2] * 3, 11.0, stats=stats)
    assert stats["method"] in ("dual", "pareto")
    # identical layers: dominance pruning sees the same rows; strategy 2 is dominated by 0 everywhere
    stats = {}
    dp.solve_stage([[1.0, 2.0, 1.5]] * 4, [[5.0, 1.0, 6.0]] * 4, [[[0.0] * 3] * 3] * 4, 12.0, stats=stats)
    assert stats["live_strategies"] == 8


def test_stage_level_reduction_is_exact() -> None:
    """Each transient level reduced to the candidates no other of its transition class matches or beats (stages.py)
    has the optimum of the whole level, and the level's lower bound is below it (random stages, expert-like groups)."""
    import numpy as np

    from galva_search.stages import level_bound, transition_classes, undominated_beats

    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(40):
        L, groups, per = int(rng.integers(2, 6)), int(rng.integers(2, 4)), int(rng.integers(1, 4))
        S = groups * per
        base = rng.uniform(0.0, 2.0, (L, groups, groups))
        inter = np.repeat(np.repeat(base, per, axis=1), per, axis=2)  # same transitions inside a group
        intra = rng.uniform(1.0, 1.2, (L, S))
        intra[rng.uniform(size=(L, S)) < 0.1] = np.inf
        memory = rng.uniform(1.0, 4.0, (L, S))
        transient = np.tile(rng.choice([0.0, 0.5, 1.0], S), (L, 1))
        budget = float(rng.uniform(1.5, 3.5) * L)
        classes = transition_classes(inter)
        assert len(set(classes.tolist())) <= groups
        for tau in np.unique(transient):
            masked = np.where(transient <= tau, intra, np.inf)
            whole = dp.solve_stage(masked, memory, inter, budget - tau)
            keep = (np.isfinite(masked) & np.isfinite(memory)).any(axis=0)
            keep &= ~undominated_beats(masked, memory, classes).any(axis=0)
            cols = np.flatnonzero(keep)
            if len(cols) == 0:
                assert whole is None
                continue
            reduced = dp.solve_stage(masked[:, cols], memory[:, cols], inter[:, cols[:, None], cols], budget - tau)
            assert (whole is None) == (reduced is None)
            if whole is not None and reduced is not None:
                assert reduced.time == pytest.approx(whole.time, rel=1e-12)
                level = ((), budget - tau, (masked[:, cols], memory[:, cols], inter[:, cols[:, None], cols]), cols)
                assert level_bound(level) <= whole.time * (1 + 1e-9)
                checked += 1
    assert checked > 20


@needs_cpp
@pytest.mark.parametrize("cutoffs", [True, False])
def test_stage_levels_in_the_core_give_each_stage_its_optimum(cutoffs: bool) -> None:
    """The C++ core's transient levels (dp.StageLevels / dp.solve_stages: reduction, bounds, rounds, the solution
    cache across budgets, cutoffs) give every stage the optimum of its definition: the least time over the levels
    tau of the unreduced stage DP with candidates above tau forbidden and the budget lowered by tau. Random stages
    with expert-like groups, transients the same at every layer or not, repeated layers, several budgets per stage."""
    import numpy as np

    rng = np.random.default_rng(11)
    checked = 0
    for trial in range(30):
        L, groups, per = int(rng.integers(2, 6)), int(rng.integers(2, 4)), int(rng.integers(1, 4))
        S = groups * per
        base = rng.uniform(0.0, 2.0, (L, groups, groups))
        # few distinct values: candidates often match or beat others, inside their group and across groups
        intra = rng.choice([1.0, 1.1, 1.2], (L, S))
        intra[rng.uniform(size=(L, S)) < 0.1] = np.inf
        memory = rng.choice([1.0, 2.0, 3.0, 4.0], (L, S))
        if trial % 3 == 0:  # layers of one type: the same costs and transition block
            base[1:], intra[1:], memory[1:] = base[1], intra[1], memory[1]
        inter = np.repeat(np.repeat(base, per, axis=1), per, axis=2)  # same transitions inside a group
        if trial % 2:
            transient = np.tile(rng.choice([0.0, 0.5, 1.0], S), (L, 1))
        else:
            transient = rng.choice([0.0, 0.5, 1.0], (L, S))
        levels = dp.StageLevels(intra, memory, inter, transient)
        budgets = [float(rng.uniform(1.5, 3.5) * L) for _ in range(3)]
        # several stages share one StageLevels (the search's cache); the last asks again under the first budget
        got, _, _ = dp.solve_stages([(levels, b) for b in [*budgets, budgets[0]]], threads=1, cutoffs=cutoffs)
        assert got[0] == got[-1]
        # the same stage given as its distinct transition blocks (last seen first) and each layer's block
        distinct: dict[bytes, int] = {}
        for layer in reversed(range(L)):
            distinct.setdefault(inter[layer].tobytes(), layer)
        order = list(distinct.values())
        block = [order.index(distinct[inter[layer].tobytes()]) for layer in range(L)]
        by_block = dp.StageLevels(intra, memory, inter[order], transient, block)
        assert by_block.levels == levels.levels
        again, _, _ = dp.solve_stages([(by_block, b) for b in [*budgets, budgets[0]]], threads=1, cutoffs=cutoffs)
        assert again == got
        for budget, sol in zip(budgets, got):
            best = None
            for tau in np.unique(transient[np.isfinite(intra)]):
                masked = np.where(transient <= tau, intra, np.inf)
                whole = dp.solve_stage(masked, memory, inter, budget - tau)
                if whole is not None and (best is None or whole.time < best.time):
                    best = whole
            assert (sol is None) == (best is None)
            if sol is not None and best is not None:
                assert sol.time == pytest.approx(best.time, rel=1e-12)
                t, m = dp.plan_cost(intra, memory, inter, sol.choice)
                assert t == pytest.approx(sol.time, rel=1e-12)
                assert m + max(transient[i, s] for i, s in enumerate(sol.choice)) <= budget * (1 + 1e-12)
                checked += 1
    assert checked > 40
    with pytest.raises(ValueError, match="block"):  # a layer's block outside the blocks given
        dp.StageLevels(intra, memory, inter[:1], transient, [0] * (L - 1) + [1])
