"""The outer search: batch sizes, partitions, exact optimum on small cases, validity of every written plan."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from galva_schema import (
    DataParallelType,
    ModelProfile,
    PipelineSchedule,
    SchemaError,
    SearchSummary,
    Strategy,
)
from galva_search.cost_model import CostModel, CostSettings
from galva_search.partition import balanced_division, even_division
from galva_search.search import NoFeasibleStrategy, SearchOptions, batch_size_range, evaluate_strategy, search
from galva_search.space import SpaceOptions, generate_space
from galva_search.summary import layer_runs, text_summary


def test_batch_size_range_matches_the_reference_rule():
    assert batch_size_range(16, 64, 8) == [16, 24, 32, 40, 48, 56, 64]
    assert batch_size_range(1, 50, 16) == [16, 32, 48]
    assert batch_size_range(20, 40, 8) == [16, 24, 32, 40]
    with pytest.raises(ValueError):
        batch_size_range(8, 64, 0)


def test_balanced_division():
    assert even_division(10, 4) == [2, 2, 2, 4]
    assert balanced_division([(80, [1, 1, 1, 1])], [0, 0, 0, 0]) == [20, 20, 20, 20]
    # 1F1B-like: stage s holds more micro-batches the earlier it is, so earlier stages get fewer layers
    assert balanced_division([(80, [4, 3, 2, 1])], [0, 0, 0, 0]) == [9, 13, 19, 39]
    assert balanced_division([(80, [1, 1, 1, 1])], [10, 0, 0, 10]) == [15, 25, 25, 15]
    assert balanced_division([(10, [1, 1]), (10, [3, 3])], [0, 0]) == [13, 7]  # two layer types
    assert balanced_division([(3, [1, 1, 1, 1])], [0, 0, 0, 0]) is None


# ------------------------------------------------------------------------------------------------ exact optimum
def brute_force_pp1(cost: CostModel, space, batch: int, usable: float, allow_sp: bool):
    """Best (seconds per sample, iteration time) over every micro-batch count, vocabulary plan and per-layer choice of
    a single-stage model, enumerating all S^L plans with numpy; uses only the cost model's public functions."""
    world = cost.world_size
    layers = cost.model.num_layers
    best = None
    for c in [d for d in range(1, batch + 1) if batch % d == 0]:
        micro = batch // c
        allowed = [cand for cand in space if micro % cand.dp == 0]
        if not allowed:
            continue
        t = cost.layer_terms(0, allowed, micro, c)
        r = cost.redistribution(0, allowed, micro)
        combos = np.array(list(itertools.product(range(len(allowed)), repeat=layers)))
        # a plan's peak: every layer's states and activations, plus the largest transient of any one layer (a
        # ZeRO-3 gather or a recomputation, held only while that layer runs)
        mem = t.memory_mib(1)[combos].sum(axis=1) + t.transient_mib[combos].max(axis=1)
        u = t.micro_batch_s[combos].sum(axis=1) + sum(r[combos[:, i - 1], combos[:, i]] for i in range(1, layers))
        e = t.exposed_sync_s[combos].sum(axis=1)
        for option in cost.vocab_options(1, 8, allow_sp=allow_sp, allow_zero3=True):
            if micro % (world // option.tp):
                continue
            (v,) = cost.vocab_terms(1, option, micro, c, [1])
            fits = mem + v.memory_mib + cost.settings.context_mib <= usable
            if not fits.any():
                continue
            # re-sharding from the embedding into the first layer and from the last layer into the head
            into, out = cost.vocab_boundaries(option, allowed, micro)
            edges = into[combos[:, 0]] + out[combos[:, -1]]
            total = c * (u + edges + v.micro_batch_s) + np.maximum(e + v.exposed_sync_s, 0.0)
            time = float(total[fits].min())
            if best is None or time / batch < best[0]:
                best = (time / batch, time)
    return best


@pytest.mark.parametrize("sp_space", ["tp", "tp+sp"])
@pytest.mark.parametrize("budget", [300.0, 500.0, 700.0, 900.0, 1300.0])
def test_search_finds_the_brute_force_optimum_on_one_stage(make_hw, make_model, budget, sp_space):
    """Every micro-batch count, vocabulary plan and S^3 per-layer plan, against the planner (bounds, pruning,
    solution reuse and the DP included). With one stage the DP's objective is the iteration time itself."""
    hw, model = make_hw(4), make_model(3)
    cost = CostModel(hw, model, CostSettings(context_mib=0.0, default_dp_type=DataParallelType.ZERO2))
    space_options = SpaceOptions(disable_pp=True, sp_space=sp_space)
    space = generate_space(4, space_options)
    expected = brute_force_pp1(cost, space, 8, budget, sp_space != "tp")
    options = SearchOptions(memory_budget_mib=budget, batch_sizes=(8,), space=space_options, memory_reserve_mib=0.0)
    if expected is None:
        with pytest.raises(NoFeasibleStrategy):
            search(cost, options)
        return
    result = search(cost, options)
    assert result.summary.iteration_time_s == pytest.approx(expected[1], rel=1e-7)
    assert max(result.summary.stage_memory_mib) <= budget
    Strategy.from_dict(result.strategy.to_dict())


def test_tight_budget_forces_some_layers_to_checkpoint(make_hw, make_model):
    """Hand-made: with one candidate per checkpoint flag and a budget that fits exactly k checkpointed layers,
    the optimum checkpoints as few layers as fit, in one contiguous run (additive tie-breakers)."""
    hw, model = make_hw(2), make_model(6)
    cost = CostModel(hw, model, CostSettings(context_mib=0.0))
    options = SpaceOptions(preset="full", disable_pp=True, disable_tp=True, disable_sdp=True, disable_vtp=True)
    space = generate_space(2, options)
    assert [(c.pp, c.tp, c.dp, c.checkpoint) for c in space] == [(1, 1, 2, False), (1, 1, 2, True)]
    terms = cost.layer_terms(0, space, 2, 1)
    (vocab,) = cost.vocab_terms(1, cost.vocab_options(1, 1, allow_sp=False, allow_zero3=False)[0], 2, 1, [1])
    plain, ckpt = terms.memory_mib(1)
    # room for exactly two uncheckpointed layers, and for one checkpointed layer's recomputation during its backward
    budget = vocab.memory_mib + 2 * plain + 4 * ckpt + float(terms.transient_mib[1]) + 1.0
    result = search(cost, SearchOptions(memory_budget_mib=budget, batch_sizes=(2,), space=options,
                                        num_micro_batches=1, memory_reserve_mib=0.0))
    flags = [layer.checkpoint for layer in result.strategy.layers]
    assert sum(flags) == 4
    assert flags == sorted(flags) or flags == sorted(flags, reverse=True)


def test_pipeline_memory_follows_the_schedule(make_hw, make_model):
    """preset pp: 4-1-1 on 4 devices, 4 layers, 8 micro-batches of 1 sample. GPipe keeps all 8 micro-batches'
    activations on every stage; 1F1B keeps 4 - s on stage s."""
    hw, model = make_hw(4), make_model(4)
    per_stage = {}
    for schedule in (PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B):
        cost = CostModel(hw, model, CostSettings(context_mib=0.0, pipeline_schedule=schedule))
        result = search(cost, SearchOptions(memory_budget_mib=16384.0, batch_sizes=(8,), num_micro_batches=8,
                                            space=SpaceOptions(preset="pp"), partitions=("even",)))
        assert result.strategy.pp == 4 and result.strategy.pp_division == (1, 1, 1, 1)
        per_stage[schedule] = result.summary.stage_memory_mib
    states = 64 / 4 * 18  # 16 Mi parameters x 18 bytes (galva-hp's ddp: bf16 weight, fp32 gradient, master, Adam)
    act = 10.0  # one sample per micro-batch
    vocab_states, vocab_act = 400.0, 40.0
    gpipe = per_stage[PipelineSchedule.GPIPE]
    one_f_one_b = per_stage[PipelineSchedule.ONE_F_ONE_B]
    assert gpipe[1] == pytest.approx(states + 8 * act)
    assert one_f_one_b[1] == pytest.approx(states + 3 * act)
    assert gpipe[0] == pytest.approx(vocab_states + 8 * vocab_act + states + 8 * act)
    assert one_f_one_b[0] == pytest.approx(vocab_states + 4 * vocab_act + states + 4 * act)
    assert one_f_one_b[3] == pytest.approx(vocab_states + vocab_act + states + act)


# ------------------------------------------------------------------------------------------------ real-size cases
def test_llama7b_on_one_node(hw_1x8, llama7b):
    cost = CostModel(hw_1x8, llama7b)
    budget = 36e9 / 2**20
    result = search(cost, SearchOptions(memory_budget_mib=budget, batch_sizes=tuple(range(8, 129, 8)),
                                        space=SpaceOptions(sp_space="tp+sp")))
    s = Strategy.from_dict(result.strategy.to_dict())
    assert s.num_layers == 32 and s.world_size == 8
    assert all(m <= result.summary.usable_memory_mib for m in result.summary.stage_memory_mib)
    assert result.summary.usable_memory_mib == pytest.approx(0.95 * budget)  # the default reserve: 5% for fragmentation
    summary = result.summary
    assert summary.throughput_samples_per_s == pytest.approx(s.global_batch_size / summary.iteration_time_s)
    counts = result.summary.counts
    assert counts.tasks == counts.solved + counts.infeasible + counts.pruned_bound + counts.pruned_memory
    assert len(result.log) == counts.tasks
    assert sum(r.status == "best" for r in result.log) == 1
    # the plan re-evaluated from the written strategy alone gives the same time and memory
    assert len(result.candidates) == 32
    evaluation = evaluate_strategy(cost, s)
    assert evaluation.iteration_time_s == pytest.approx(result.summary.iteration_time_s, rel=1e-9)
    assert evaluation.stage_memory_mib == pytest.approx(result.summary.stage_memory_mib, rel=1e-9)
    text = text_summary(result.strategy, result.summary)
    assert "samples/s" in text and "stage 0" in text
    written = json.loads(json.dumps(summary.to_dict()))
    assert written["pp"] == s.pp and len(written["stage_memory_mib"]) == s.pp
    assert SearchSummary.from_dict(written) == summary  # the file reads back as what was written
    assert summary.mismatch(s) is None


def test_global_mode_uses_one_strategy(hw_1x8, llama7b):
    cost = CostModel(hw_1x8, llama7b)
    result = search(cost, SearchOptions(memory_budget_mib=36 * 1024, batch_sizes=(32,), fine_grained=False))
    assert len({layer for layer in result.strategy.layers}) == 1
    fine = search(cost, SearchOptions(memory_budget_mib=36 * 1024, batch_sizes=(32,)))
    assert fine.summary.throughput_samples_per_s >= result.summary.throughput_samples_per_s * (1 - 1e-9)


def test_several_layer_types(hw_1x8, llama7b):
    data = llama7b.to_dict()
    decoder = data["layer_types"][0]
    encoder = {**decoder, "name": "encoder", "num_layers": 8, "hidden_size": 2048, "parameter_mib": 200.0,
               "forward_time": {"form": "static", "ms_per_sample": 1.5},
               "activation_mib_per_sample": {"1": 80.0, "2": 50.0, "4": 35.0, "8": 28.0},
               "checkpoint_activation_mib_per_sample": 8.0}
    data["layer_types"] = [encoder, {**decoder, "num_layers": 24}]
    model = ModelProfile.from_dict(data)
    cost = CostModel(hw_1x8, model)
    result = search(cost, SearchOptions(memory_budget_mib=24 * 1024, batch_sizes=(32, 64)))
    s = Strategy.from_dict(result.strategy.to_dict())
    assert s.num_layers == 32
    assert sum(s.pp_division) == 32


def test_no_feasible_strategy_names_the_budget(hw_1x8, llama7b):
    cost = CostModel(hw_1x8, llama7b)
    with pytest.raises(NoFeasibleStrategy, match=r"no feasible strategy.*2048 MiB per device"):
        search(cost, SearchOptions(memory_budget_mib=2048, batch_sizes=(64,)))


def test_runs_in_summary(hw_1x8, llama7b):
    cost = CostModel(hw_1x8, llama7b)
    result = search(cost, SearchOptions(memory_budget_mib=24 * 1024, batch_sizes=(64,)))
    runs = layer_runs(result.strategy)
    assert runs[0].first == 0 and runs[-1].last == 31
    covered = sum(run.last - run.first + 1 for run in runs)
    assert covered == 32
    assert list(result.summary.layer_runs) == runs


def test_importing_and_searching_never_imports_torch(data_dir, tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        import galva_search, galva_search.cli, galva_search.search, galva_search.dp
        code = galva_search.cli.main([
            "--hardware-profile", {str(data_dir / "hw_1x8.json")!r},
            "--model-profile", {str(data_dir / "llama7b_model.json")!r},
            "--memory", "36GB", "--global-batch-size", "16", "--quiet",
            "--output", {str(tmp_path / "s.json")!r},
        ])
        assert code == 0, code
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not loaded, loaded
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


@pytest.mark.parametrize("schedule", [PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.GPIPE])
def test_pruning_by_bound_never_loses_the_best_task(make_hw, make_model, schedule):
    """Every pipeline degree, partition and vocabulary plan: the pruned search returns the same plan cost as solving
    every task (the bound is a true lower bound on every plan of a task)."""
    hw = make_hw(4)
    slow = tuple(e.model_copy(update={"bus_bandwidth_gb_per_s": e.bus_bandwidth_gb_per_s / 50}) for e in hw.allreduce)
    hw = hw.model_copy(update={"allreduce": slow})  # slow collectives: pp 1, 2 and 4 all win somewhere
    cost = CostModel(hw, make_model(6), CostSettings(context_mib=0.0, pipeline_schedule=schedule))
    degrees = set()
    for budget in (600.0, 900.0, 1500.0, 4000.0):
        common = dict(memory_budget_mib=budget, batch_sizes=(8, 16), space=SpaceOptions(sp_space="tp+sp"),
                      memory_reserve_mib=0.0)
        pruned = search(cost, SearchOptions(**common))
        every = search(cost, SearchOptions(**common, exhaustive=True))
        assert pruned.summary.iteration_time_s / pruned.strategy.global_batch_size == pytest.approx(
            every.summary.iteration_time_s / every.strategy.global_batch_size, rel=1e-9)
        assert every.summary.counts.pruned_bound == 0
        assert every.summary.counts.solved >= pruned.summary.counts.solved
        degrees.add(pruned.strategy.pp)
    assert len(degrees) >= 2


def test_partition_refinement_only_improves(hw_1x8, llama7b):
    cost = CostModel(hw_1x8, llama7b, CostSettings(pipeline_schedule=PipelineSchedule.ONE_F_ONE_B))
    common = dict(memory_budget_mib=20 * 1024, batch_sizes=(64,), num_micro_batches=32,
                  space=SpaceOptions(disable_tp=True, max_pp=4), partitions=("even",))
    plain = search(cost, SearchOptions(**common, refine_division=False))
    refined = search(cost, SearchOptions(**common))
    assert plain.strategy.pp > 1
    assert refined.summary.throughput_samples_per_s >= plain.summary.throughput_samples_per_s * (1 - 1e-12)
    assert sum(refined.strategy.pp_division) == 32
    if refined.strategy.pp_division != plain.strategy.pp_division:
        assert any(r.status.endswith("(refined)") or r.status == "best" for r in refined.log)


def test_evaluate_strategy_scores_pipelines_and_rejects_mismatches(hw_1x8, llama7b):
    cost = CostModel(hw_1x8, llama7b)
    options = SearchOptions(memory_budget_mib=20e9 / 2**20,  # 20 GB: room for the 5% reserve and transients
        batch_sizes=(64,), space=SpaceOptions(max_tp=2))
    result = search(cost, options)
    assert result.strategy.pp > 1  # a tight budget and max_tp 2 force a pipeline
    evaluation = evaluate_strategy(cost, Strategy.from_dict(result.strategy.to_dict()))
    assert evaluation.iteration_time_s == pytest.approx(result.summary.iteration_time_s, rel=1e-9)
    wrong_world = Strategy.uniform(world_size=4, num_layers=32, global_batch_size=8)
    with pytest.raises(SchemaError, match="world_size: the strategy has 4 ranks but the run has 8"):
        evaluate_strategy(cost, wrong_world)
    wrong_layers = Strategy.uniform(world_size=8, num_layers=30, global_batch_size=8)
    with pytest.raises(SchemaError, match=r"layers: the strategy has 30 layers but .* has 32"):
        evaluate_strategy(cost, wrong_layers)


def test_stage_boundary_refinement_prices_what_crosses_stages(hw_1x8, llama7b):
    """A stage's DP cannot see the layer the previous stage ends with; re-solving stages knowing it only improves,
    and here (Megatron and Ulysses layers mixed in a 4-stage pipeline) it finds a faster plan."""
    cost = CostModel(hw_1x8, llama7b)
    common = dict(memory_budget_mib=36e9 / 2**20, batch_sizes=(128,), num_micro_batches=128,
                  memory_reserve_mib=0.2 * 36e9 / 2**20,  # the scenario was built under the former 20% default
                  space=SpaceOptions(sp_space="tp+sp"), partitions=("even",))
    plain = search(cost, SearchOptions(**common, refine_division=False))
    refined = search(cost, SearchOptions(**common))
    assert plain.strategy.pp == refined.strategy.pp == 4
    assert refined.summary.iteration_time_s < plain.summary.iteration_time_s
    assert refined.summary.counts.refined >= 1
    assert evaluate_strategy(cost, refined.strategy).iteration_time_s == pytest.approx(refined.summary.iteration_time_s,
                                                                                     rel=1e-12)
    assert sum(r.status == "best" for r in refined.log) == 1


def test_when_nothing_fits_the_message_says_the_batch_and_the_budget_that_would(make_hw, make_model):
    """The hint is checked by searching again with what it names: that batch fits this budget, twice that batch does
    not, and the budget it names fits the batch asked while 5% less does not (within the stated 2% precision)."""
    import re

    hw, model = make_hw(4), make_model(3)
    cost = CostModel(hw, model, CostSettings(context_mib=0.0))
    fixed = {"memory_reserve_mib": 0.0, "num_micro_batches": 1}  # one micro-batch: memory grows with the batch
    options = SearchOptions(memory_budget_mib=600.0, batch_sizes=(64,), **fixed)
    with pytest.raises(NoFeasibleStrategy) as err:
        search(cost, options)
    line = str(err.value)
    assert "\n" not in line
    batch = int(re.search(r"global batch size (\d+) fits this budget", line).group(1))
    budget = float(re.search(r"batch size 64 fits a budget of (\d+) MiB", line).group(1))
    assert 1 <= batch < 64 and budget > 600.0, line
    search(cost, SearchOptions(memory_budget_mib=600.0, batch_sizes=(batch,), **fixed))
    with pytest.raises(NoFeasibleStrategy):
        search(cost, SearchOptions(memory_budget_mib=600.0, batch_sizes=(2 * batch,), **fixed))
    search(cost, SearchOptions(memory_budget_mib=budget, batch_sizes=(64,), **fixed))
    with pytest.raises(NoFeasibleStrategy):
        search(cost, SearchOptions(memory_budget_mib=0.95 * budget, batch_sizes=(64,), **fixed))


@pytest.mark.parametrize("budget", [16384.0, 1500.0])
def test_stage_levels_in_the_core_choose_what_the_python_rules_choose(make_hw, make_model, budget, monkeypatch):
    """The searched plan and its predicted time are bit for bit the same whether the stages' transient levels are
    reduced, bounded, cached and solved by the C++ core (StageSolver.solve) or by the Python statement of their rules
    (StageSolver.solve_python): a tiny layer with routed experts (expert layouts, ZeRO-3 and checkpointing: several
    levels per stage), from a roomy budget to a tight one."""
    from galva_schema import BatchTime, ExpertProfile
    from galva_search import dp

    if not dp.has_cpp():
        pytest.skip("C++ extension galva_search._core not built")
    model = make_model(6)
    experts = ExpertProfile(
        num_experts=4, top_k=2, expert_ffn=256, expert_parameter_mib=48.0, block_parameter_mib=1.0,
        expert_time=BatchTime(slope_ms_per_sample=0.001, intercept_ms=0.01), router_ms_per_token=0.0,
        imbalance={1: 1.0, 2: 1.1, 4: 1.25}, activation_mib_per_row=0.001, dispatch_activation_mib_per_row=0.0001,
    )
    model = model.model_copy(update={"layer_types": (model.layer_types[0].model_copy(update={"experts": experts}),)})
    cost = CostModel(make_hw(8), model, CostSettings())
    options = SearchOptions(memory_budget_mib=budget, batch_sizes=(16,), space=SpaceOptions(max_ep=4, max_tp=4),
                            memory_reserve_mib=0.0)
    core = search(cost, options)
    monkeypatch.setattr(dp, "has_cpp", lambda: False)
    rules = search(cost, options)
    assert core.strategy == rules.strategy
    assert core.summary.iteration_time_s == rules.summary.iteration_time_s
    assert core.summary.counts.dp_problems == rules.summary.counts.dp_problems  # the same levels solved


@pytest.mark.parametrize("pp", [1, 2])
def test_the_stage_dp_prices_every_plan_as_the_score_does_with_bucketed_ddp_layers(make_hw, make_model, pp):
    """Exact in its own model where galva-hp's ddp buckets matter (layers of 0.5 MiB of gradients under a 1.2 MiB
    cap: 2 layers a bucket at tp 1, 4 at tp 2, a remainder bucket of 1): over random per-layer plans of a stage
    (ddp at tp 1, 2, 4, checkpointed or not, mixed), the score (task_cost) of the stage's plan minus the stage DP's
    objective for it (less its tie-breaking switch penalties) is one constant (the vocabulary, the optimizer call, the
    other stage), so the plan the DP picks is the one the score ranks first, and its score is the DP's time plus that
    constant. With two stages, the first one (the second's DP prices the backward p2p it receives in its own first
    layer's layout until :meth:`StageSolver.solve_after` re-solves it knowing the sender's)."""
    from galva_schema import CollectiveTimes
    from galva_search.evaluation import task_cost
    from galva_search.rules import ModelRules
    from galva_search.stages import StageSolver
    from galva_search.tasks import TaskEnumerator

    tiny = make_model(5 * pp)
    small = tiny.model_copy(update={"layer_types": (tiny.layer_types[0].model_copy(update={"parameter_mib": 0.5}),)})
    curves = tuple(CollectiveTimes(group_size=n, message_mib=(0.00390625, 4.0), time_ms=(1.0, 2.0)) for n in (2, 4))
    hw = make_hw(4).model_copy(update={"allreduce_time": curves, "optimizer_ms_per_million_parameters": 0.0})
    cost = CostModel(hw, small, CostSettings(context_mib=0.0, bucket_cap_bytes=1.2 * 2**20))
    space = SpaceOptions(disable_sdp=True, disable_vtp=True)
    by_pp: dict = {}
    for c in generate_space(4, space):
        by_pp.setdefault(c.pp, []).append(c)
    options = SearchOptions(memory_budget_mib=1e6, batch_sizes=(8,), space=space, memory_reserve_mib=0.0,
                            num_micro_batches=2, partitions=("even",))
    tasks = TaskEnumerator(cost, options, by_pp, ModelRules(cost.model, cost.settings, 4))
    solver = StageSolver(tasks, 1, {"dp_problems": 0, "dp_reused": 0})
    task = next(t for t in tasks.enumerate() if t.pp == pp)
    terms = task.tables.terms[0]
    shares = task.tables.sync_share(cost, 0, 5)
    assert (shares < terms.exposed_sync_s - 1e-6).sum() >= 2  # the buckets matter: ddp candidates pay fewer latencies
    (solutions,) = solver.solve([task])
    best = [sol.choice for sol in solutions]
    rng = np.random.default_rng(0)
    _, (intra, _, inter) = solver.stage_problem(task, 0)
    L = intra.shape[0]
    allowed = np.flatnonzero(np.isfinite(intra).all(axis=0))
    assert len(allowed) >= 4 and {task.tables.candidates[s].tp for s in allowed} >= {1, 2}
    penalty = task.tables.penalty[0]

    def dp_time(choice) -> float:
        return float(sum(intra[i, s] for i, s in enumerate(choice))
                     + sum(inter[i, choice[i - 1], s] for i, s in enumerate(choice) if i > 0))

    def switches(choice) -> float:
        return float(sum(penalty[choice[i - 1], s] for i, s in enumerate(choice) if i > 0))

    def score(choice) -> float:
        got = task_cost(cost, tasks.layers, task, [choice, *best[1:]])
        if pp == 1:
            return got.iteration_time_s
        # a stage's DP objective is its own iteration seconds: c times its micro-batch time, its exposed sync
        return task.micro_batches * got.stage_time_s[0] + got.stage_exposed_s[0]

    offset = score(best[0]) - dp_time(best[0]) + switches(best[0])
    plans = [tuple(int(s) for s in rng.choice(allowed, L)) for _ in range(60)] + [(int(s),) * L for s in allowed]
    for choice in plans:
        assert score(choice) - dp_time(choice) + switches(choice) == pytest.approx(offset, rel=1e-12, abs=1e-15)
        assert dp_time(choice) >= solutions[0].time - 1e-12
    assert dp_time(best[0]) == pytest.approx(solutions[0].time, rel=1e-12)
