"""Pipeline schedules in the cost model and the search: 1F1B, GPipe, interleaved 1F1B (v chunks per stage), zb-h1.

Hand-computed bubble, in-flight and p2p terms (docs/cost-model.md §4, §7), the in-flight count against a simulation of
Megatron's interleaved order, and the search's choice of schedule against brute force.
"""

from __future__ import annotations

import contextlib
import itertools
import json

import pytest

from galva_schema import DataParallelType, LayerStrategy, PipelineSchedule, Strategy
from galva_search.cli import main
from galva_search.cost_model import (
    CostModel,
    CostSettings,
    VocabOption,
    interleaved_chunks_in_flight,
    pipeline_time,
)
from galva_search.evaluation import evaluate_strategy
from galva_search.report import html_report
from galva_search.search import NoFeasibleStrategy, SearchOptions, search
from galva_search.space import SpaceOptions, generate_space
from galva_search.summary import text_summary

ONE = PipelineSchedule.ONE_F_ONE_B
GPIPE = PipelineSchedule.GPIPE
INTER = PipelineSchedule.INTERLEAVED_1F1B
ZB = PipelineSchedule.ZB_H1


def _megatron_peak(pp: int, v: int, c: int, stage: int) -> int:
    """Micro-batch-chunks held at the peak of ``stage``, replaying Megatron's interleaved order step by step: the
    warm-up forwards (``get_num_warmup_microbatches``), then one forward and one backward per step, then the
    cool-down backwards."""
    total = c * v
    warmup = total if c == pp else min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    held = peak = 0
    for _ in range(warmup):
        held += 1
        peak = max(peak, held)
    for _ in range(total - warmup):
        held += 1  # one forward
        peak = max(peak, held)
        held -= 1  # one backward
    for _ in range(warmup):
        held -= 1
    assert held == 0
    return peak


@pytest.mark.parametrize(
    ("pp", "v", "c"), [(2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 16), (2, 4, 4), (4, 3, 12)]
)
def test_interleaved_in_flight_follows_megatrons_order(pp, v, c):
    assert interleaved_chunks_in_flight(pp, c, v) == [_megatron_peak(pp, v, c, s) for s in range(pp)]


def test_in_flight_per_schedule(tiny, tiny_hw):
    cost = CostModel(tiny_hw, tiny)
    assert cost.in_flight(4, 8, ONE) == [4, 3, 2, 1]
    assert cost.in_flight(4, 8, GPIPE) == [8] * 4
    # zb-h1: 1F1B's pp - s forwards plus s micro-batches whose deferred weight gradient still holds its inputs
    assert cost.in_flight(4, 8, ZB) == [4] * 4
    assert cost.in_flight(4, 2, ZB) == [2] * 4
    # interleaved, v = 2: 2 (pp - s - 1) + (v - 1) pp + 1 micro-batch-chunks, each half a stage's activations
    assert interleaved_chunks_in_flight(4, 8, 2) == [11, 9, 7, 5]
    assert cost.in_flight(4, 8, INTER, 2) == [5.5, 4.5, 3.5, 2.5]
    # c = pp: every stage runs every forward before its first backward (v c chunks)
    assert interleaved_chunks_in_flight(2, 2, 2) == [4, 4]
    assert interleaved_chunks_in_flight(4, 4, 2) == [8, 8, 8, 8]
    assert cost.in_flight(1, 8, INTER, 2) == [1]
    # the settings' schedule is the default
    assert CostModel(tiny_hw, tiny, CostSettings(pipeline_schedule=ZB)).in_flight(4, 8) == [4] * 4


def test_pipeline_time_per_schedule():
    u, e = [1.0, 2.0, 1.0], [0.5, 3.5, 0.0]
    # 1F1B: c U_max + the other stages once + the sync tail of stage 1 (3.5 less stage 0's 1.0 lead)
    t = pipeline_time(u, e, 4)
    assert (t.total, t.steady, t.bubble, t.tail, t.slowest) == pytest.approx((12.5, 8.0, 2.0, 2.5, 1))
    assert pipeline_time(u, e, 4).total == pytest.approx(4 + 3 * 2 + 2.5)
    assert pipeline_time(u, e, 4, GPIPE).total == pytest.approx(12.5)
    # interleaved, v = 2: fill and drain walk half of each other stage; stage 1 leads by 0.5 only
    t = pipeline_time(u, e, 4, INTER, 2)
    assert (t.bubble, t.tail, t.total) == pytest.approx((1.0, 3.0, 12.0))
    # zb-h1: each other stage's bubble share is U - 2 W
    w = [0.25, 0.5, 0.25]
    t = pipeline_time(u, e, 4, ZB, 1, w)
    assert (t.bubble, t.tail, t.total) == pytest.approx((1.0, 3.0, 12.0))
    # fewer micro-batches than stages: no weight gradient can be deferred, 1F1B's bubble
    assert pipeline_time(u, e, 2, ZB, 1, w).total == pytest.approx(pipeline_time(u, e, 2).total)
    # equal stages: Megatron's (pp - 1) U / v, the paper's (pp - 1)(F + B - W)
    assert pipeline_time([1.0] * 4, [0.0] * 4, 8, INTER, 2).total == pytest.approx(8 + 3 / 2)
    assert pipeline_time([3.0] * 4, [0.0] * 4, 8, ZB, 1, [1.0] * 4).total == pytest.approx(8 * 3 + 3 * (1 + 1 - 1))
    assert pipeline_time([3.0] * 4, [0.0] * 4, 8).total == pytest.approx(8 * 3 + 3 * 3)


def test_weight_gradient_is_half_the_backward_compute(tiny, tiny_hw):
    cost = CostModel(tiny_hw, tiny, CostSettings(backward_coefficient=2.0))
    cands = [c for c in generate_space(4, SpaceOptions()) if c.pp == 1]
    t = cost.layer_terms(0, cands, 8, 2)
    assert t.weight_grad_s == pytest.approx(t.forward_s)  # beta / 2 = 1 forward; recomputation is not W
    assert any(c.checkpoint for c in cands)
    for i, c in enumerate(cands):
        recompute = t.forward_s[i] if c.checkpoint else 0.0
        assert t.backward_s[i] == pytest.approx(2 * t.weight_grad_s[i] + recompute)


def test_a_measured_weight_share_replaces_the_half(tiny, tiny_hw):
    """The model profile's weight_grad_share (zb-h1 over-predicted with 1/2 where the runtime's W is smaller)."""
    measured = tiny.model_copy(update={"layer_types": (tiny.layer_types[0].model_copy(
        update={"weight_grad_share": 0.2}),)})
    cands = [c for c in generate_space(4, SpaceOptions()) if c.pp == 1]
    half = CostModel(tiny_hw, tiny, CostSettings()).layer_terms(0, cands, 8, 2)
    got = CostModel(tiny_hw, measured, CostSettings()).layer_terms(0, cands, 8, 2)
    assert got.weight_grad_s == pytest.approx(0.4 * half.weight_grad_s)  # 0.2 of 2 forwards where 1/2 gave 1
    assert got.backward_s == pytest.approx(half.backward_s)  # the same backward, split differently


def test_the_optimizer_step_is_the_slowest_stages_after_the_pipeline(tiny, tiny_hw):
    """Every stage steps AdamW once the pipeline has drained: the iteration grows by the slowest stage's step, the
    parameters its states stand for at the profile's measured rate; a profile without the rate prices none."""
    plan = _plan("1f1b", 1)
    none = evaluate_strategy(CostModel(tiny_hw, tiny, CostSettings(context_mib=0.0)), plan).detail
    rated = tiny_hw.model_copy(update={"optimizer_ms_per_million_parameters": 3.0})
    got = evaluate_strategy(CostModel(rated, tiny, CostSettings(context_mib=0.0)), plan).detail
    assert none is not None and got is not None and none.optimizer_s == 0.0
    per_stage = [states * 2**20 / 18 / 1e6 * 3.0e-3 for states in got.stage_states_mib]  # bf16: 18 bytes a parameter
    assert got.optimizer_s == pytest.approx(max(per_stage))
    assert got.iteration_time_s == pytest.approx(none.iteration_time_s + max(per_stage))
    assert got.time_breakdown_s(4)["optimizer"] == pytest.approx(max(per_stage))
    assert sum(got.time_breakdown_s(4).values()) == pytest.approx(got.iteration_time_s)


def _plan(schedule: str, v: int, *, pp: int = 2, layers: int = 4, c: int = 4, tp: int = 1) -> Strategy:
    return Strategy.uniform(
        world_size=4, num_layers=layers, global_batch_size=8, layer={"tp": tp}, pp=pp, pipeline_schedule=schedule,
        virtual_stages=v, num_micro_batches=c,
    )


def test_p2p_per_chunk_boundary_and_in_flight_memory(tiny, tiny_hw):
    """pp 2, v 2, one layer per chunk: boundaries 0->1, 1->2 (the wrap from stage 1 back to stage 0), 2->3; each is
    a forward send by its sender and a backward send by its receiver, so each stage sends 3 times per micro-batch
    where 1F1B sends once."""
    cost = CostModel(tiny_hw, tiny, CostSettings(context_mib=0.0))
    plain = evaluate_strategy(cost, _plan("1f1b", 1)).detail
    inter = evaluate_strategy(cost, _plan("interleaved-1f1b", 2)).detail
    assert plain is not None and inter is not None
    p = plain.stage_parts_s["p2p"][0]
    assert p > 0 and plain.stage_parts_s["p2p"] == pytest.approx([p, p])
    assert inter.stage_parts_s["p2p"] == pytest.approx([3 * p, 3 * p])  # 2 (pp v - 1) = 6 sends in all
    assert inter.stage_time_s == pytest.approx([u + 2 * p for u in plain.stage_time_s])
    # activations: 1F1B holds [2, 1] micro-batches; interleaved [5, 3] micro-batch-chunks of half a stage each
    assert plain.stage_in_flight == [2, 1] and inter.stage_in_flight == [5, 3]
    assert inter.virtual_stages == 2 and inter.schedule is INTER
    for stage, (n_plain, n_inter) in enumerate(([2, 2.5], [1, 1.5])):
        extra = inter.stage_memory_mib[stage] - plain.stage_memory_mib[stage]
        assert extra == pytest.approx((n_inter - n_plain) * plain.stage_activation_mib[stage])
    # the bubble: (U_1) / 2 over the slowest stage's 4 micro-batches
    k = max(range(2), key=lambda s: inter.stage_time_s[s])
    expected = 4 * inter.stage_time_s[k] + inter.stage_time_s[1 - k] / 2
    tail = max(0.0, max(inter.stage_exposed_s[0], inter.stage_exposed_s[1] - inter.stage_time_s[0] / 2))
    assert inter.iteration_time_s == pytest.approx(expected + tail)
    assert inter.time_breakdown_s(4)["bubble"] == pytest.approx(inter.stage_time_s[1 - k] / 2)
    assert sum(inter.time_breakdown_s(4).values()) == pytest.approx(inter.iteration_time_s)


def test_zb_h1_prices_the_deferred_weight_gradient(tiny, tiny_hw):
    cost = CostModel(tiny_hw, tiny, CostSettings(context_mib=0.0))
    plain = evaluate_strategy(cost, _plan("1f1b", 1)).detail
    zb = evaluate_strategy(cost, _plan("zb-h1", 1)).detail
    assert plain is not None and zb is not None
    assert zb.stage_time_s == pytest.approx(plain.stage_time_s)  # same work per micro-batch
    # W per stage: two layers of one forward each (beta 2) plus half the vocabulary's backward
    cand = next(c for c in generate_space(4, SpaceOptions()) if c.pp == 2 and c.tp == 1
                and c.dp_type is DataParallelType.DDP and not c.checkpoint)
    fwd = float(cost.layer_terms(0, [cand], 8 // 4, 4).forward_s[0])
    vocab = cost.vocab_terms(2, VocabOption(1, False, False), 2, 4, [2, 2])
    assert vocab[0].weight_grad_s > 0
    assert zb.stage_weight_grad_s == pytest.approx([2 * fwd + vocab[0].weight_grad_s, 2 * fwd + vocab[1].weight_grad_s])
    k = max(range(2), key=lambda s: zb.stage_time_s[s])
    other = 1 - k
    bubble = zb.stage_time_s[other] - 2 * zb.stage_weight_grad_s[other]
    assert zb.bubble_s == pytest.approx(bubble)
    assert zb.iteration_time_s < plain.iteration_time_s
    # memory: every stage holds min(pp, c) = 2 micro-batches (stage 1 one more than under 1F1B)
    assert zb.stage_in_flight == [2, 2]
    assert zb.stage_memory_mib[0] == pytest.approx(plain.stage_memory_mib[0])
    assert zb.stage_memory_mib[1] - plain.stage_memory_mib[1] == pytest.approx(plain.stage_activation_mib[1])


def _uniform_brute_force(cost: CostModel, space: SpaceOptions, batch: int, usable: float, schedules, vs):
    """Best (iteration time, schedule, v) over every uniform plan (one candidate for every layer), pipeline degree,
    micro-batch count, schedule and chunk count, even partitions, vocabulary tp 1 with the default dp type, scored by
    evaluate_strategy."""
    layers = cost.model.num_layers
    best = None
    for cand in generate_space(cost.world_size, space):
        for c in [d for d in range(1, batch + 1) if batch % d == 0]:
            pairs = [(s, 1) for s in schedules if s is not INTER] + [(INTER, v) for v in vs if INTER in schedules]
            for schedule, v in pairs if cand.pp > 1 else [(ONE, 1)]:
                if schedule is INTER and (c % cand.pp or cand.pp * v > layers):
                    continue
                if schedule is ZB and c < cand.pp:
                    continue
                stage_ranks = cost.world_size // cand.pp
                layer = LayerStrategy(
                    tp=cand.tp, tp_consecutive=cand.consecutive or cand.tp in (1, stage_ranks), ulysses=cand.ulysses,
                    dp_type=cand.dp_type, checkpoint=cand.checkpoint,
                )
                try:
                    plan = Strategy.uniform(
                        world_size=cost.world_size, num_layers=layers, global_batch_size=batch,
                        layer=layer.model_dump(), pp=cand.pp, pipeline_schedule=schedule.value, virtual_stages=v,
                        num_micro_batches=c, default_dp_type=cost.settings.default_dp_type.value,
                    )
                except ValueError:
                    continue
                got = evaluate_strategy(cost, plan)
                if max(got.stage_memory_mib) > usable:
                    continue
                if best is None or got.iteration_time_s < best[0] - 1e-12:
                    best = (got.iteration_time_s, schedule, v)
    return best


@pytest.mark.parametrize("budget", [700.0, 1000.0, 1025.0, 1050.0, 1100.0, 1125.0])
def test_search_chooses_the_cheapest_schedule(make_hw, make_model, budget):
    """Uniform plans (global mode), even partitions: the search over every schedule returns the brute-force optimum
    over every candidate, micro-batch count, pipeline degree, schedule and chunk count."""
    hw = make_hw(4)
    slow = tuple(e.model_copy(update={"bus_bandwidth_gb_per_s": e.bus_bandwidth_gb_per_s / 50}) for e in hw.allreduce)
    hw = hw.model_copy(update={"allreduce": slow})  # slow collectives: pipelines win
    cost = CostModel(hw, make_model(8), CostSettings(context_mib=0.0))
    space = SpaceOptions(disable_vtp=True, disable_sdp=True)
    schedules = (ONE, INTER, ZB, GPIPE)
    expected = _uniform_brute_force(cost, space, 8, budget, schedules, (2, 4))
    options = SearchOptions(
        memory_budget_mib=budget, batch_sizes=(8,), space=space, memory_reserve_mib=0.0, fine_grained=False,
        partitions=("even",), refine_division=False, schedules=schedules, virtual_stages=(2, 4),
    )
    if expected is None:
        with pytest.raises(NoFeasibleStrategy):
            search(cost, options)
        return
    result = search(cost, options)
    assert result.summary.iteration_time_s == pytest.approx(expected[0], rel=1e-9)
    # 1F1B on one stage, zb-h1 and interleaved each win at some budget
    assert (result.strategy.pipeline_schedule, result.strategy.virtual_stages) == expected[1:] or (
        result.summary.iteration_time_s == pytest.approx(expected[0], rel=1e-12)
    )
    got = evaluate_strategy(cost, result.strategy)
    assert got.iteration_time_s == pytest.approx(result.summary.iteration_time_s, rel=1e-12)


@pytest.mark.parametrize("budget", [600.0, 900.0, 1500.0, 4000.0])
def test_auto_is_the_best_of_the_single_schedule_searches(make_hw, make_model, budget):
    """Per-layer plans: searching every schedule at once finds the best of the searches restricted to one schedule
    (the same tasks, pruned together), and its plan is scored the same by evaluate_strategy."""
    hw = make_hw(4)
    slow = tuple(e.model_copy(update={"bus_bandwidth_gb_per_s": e.bus_bandwidth_gb_per_s / 50}) for e in hw.allreduce)
    hw = hw.model_copy(update={"allreduce": slow})
    cost = CostModel(hw, make_model(8), CostSettings(context_mib=0.0))
    common = dict(memory_budget_mib=budget, batch_sizes=(8, 16), space=SpaceOptions(sp_space="tp+sp"),
                  memory_reserve_mib=0.0, refine_division=False)
    singles = {}
    for schedule in (ONE, INTER, ZB):
        with contextlib.suppress(NoFeasibleStrategy):
            singles[schedule] = search(cost, SearchOptions(**common, schedules=(schedule,)))
    if not singles:
        return
    both = search(cost, SearchOptions(**common, schedules=(ONE, INTER, ZB)))
    every = search(cost, SearchOptions(**common, schedules=(ONE, INTER, ZB), exhaustive=True))
    per_sample = {k: r.summary.iteration_time_s / r.strategy.global_batch_size for k, r in singles.items()}
    best = min(per_sample.values())
    assert both.summary.iteration_time_s / both.strategy.global_batch_size == pytest.approx(best, rel=1e-9)
    assert every.summary.iteration_time_s / every.strategy.global_batch_size == pytest.approx(best, rel=1e-9)
    s = both.strategy
    assert evaluate_strategy(cost, s).iteration_time_s == pytest.approx(both.summary.iteration_time_s, rel=1e-12)
    assert max(both.summary.stage_memory_mib) <= budget
    if s.pipeline_schedule is INTER:
        assert s.virtual_stages >= 2 and len(s.pp_division) == s.pp * s.virtual_stages
        assert s.num_micro_batches % s.pp == 0


def test_interleaved_search_partitions_into_chunks(hw_1x8, llama7b):
    """LLaMA-7B on one node, 19 GiB: the interleaved-only search writes pp x v chunks and reports them."""
    cost = CostModel(hw_1x8, llama7b)
    options = SearchOptions(memory_budget_mib=19 * 1024, batch_sizes=(32,), schedules=(INTER,), virtual_stages=(2,),
                            space=SpaceOptions(disable_pp=False), num_micro_batches=16)
    result = search(cost, options)
    s = result.strategy
    assert s.pp > 1
    assert s.pipeline_schedule is INTER and s.virtual_stages == 2
    assert len(s.pp_division) == 2 * s.pp
    assert "interleaved-1f1b (2 model chunks per stage)" in text_summary(s, result.summary)
    assert any(r.schedule == "interleaved-1f1b:2" for r in result.log)
    assert any("schedule=interleaved-1f1b:2" in r.line() for r in result.log)
    assert "interleaved-1f1b × 2" in html_report(result)
    summary = result.summary.to_dict()
    assert summary["pipeline_schedule"] == s.pipeline_schedule.value
    assert summary["virtual_stages"] == s.virtual_stages
    assert evaluate_strategy(cost, s).iteration_time_s == pytest.approx(result.summary.iteration_time_s, rel=1e-12)
    assert len(result.candidates) == s.num_layers


def test_cli_auto_schedule_and_virtual_stages(data_dir, tmp_path, capsys):
    out, summary = tmp_path / "plan.json", tmp_path / "summary.json"
    code = main([
        "--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile", str(data_dir / "llama7b_model.json"),
        "--memory", "20GiB", "--global-batch-size", "32", "--num-micro-batches", "16", "--pipeline-schedule", "auto",
        "--virtual-stages", "2", "--output", str(out), "--summary-json", str(summary), "--quiet",
    ])
    assert code == 0
    plan = Strategy.load(out)
    data = json.loads(summary.read_text())
    assert data["pipeline_schedule"] == plan.pipeline_schedule.value
    assert data["virtual_stages"] == plan.virtual_stages
    assert plan.pipeline_schedule.value in capsys.readouterr().out
    code = main([
        "--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile", str(data_dir / "llama7b_model.json"),
        "--memory", "20GiB", "--global-batch-size", "32", "--virtual-stages", "1", "--quiet",
    ])
    assert code == 2
    assert "--virtual-stages" in capsys.readouterr().err
    code = main([
        "--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile", str(data_dir / "llama7b_model.json"),
        "--memory", "20GiB", "--global-batch-size", "32", "--pipeline-schedule", "auto",
        "--galvatron-output", str(tmp_path / "g.json"), "--quiet",
    ])
    assert code == 2
    assert "gpipe and 1f1b plans only" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("schedules", "processors"), [((INTER,), None), ((ZB,), None), ((ONE, INTER, ZB), None), ((ONE, INTER, ZB), 2)]
)
def test_pruning_by_bound_never_loses_the_best_task_for_new_schedules(make_hw, make_model, schedules, processors):
    """The bounds of interleaved and zb-h1 tasks are true lower bounds: pruning returns what solving every task
    returns; also where 4 ranks share 2 processors (the busy-node price, cost_model.shared_pipeline_time)."""
    shared = {"processors_per_node": processors, "compute_slowdown": 2.0 if processors else 1.0}
    hw = make_hw(4).model_copy(update=shared)
    slow = tuple(e.model_copy(update={"bus_bandwidth_gb_per_s": e.bus_bandwidth_gb_per_s / 50}) for e in hw.allreduce)
    hw = hw.model_copy(update={"allreduce": slow})
    cost = CostModel(hw, make_model(8), CostSettings(context_mib=0.0))
    for budget in (900.0, 1500.0, 4000.0):
        common = dict(memory_budget_mib=budget, batch_sizes=(8, 16), space=SpaceOptions(sp_space="tp+sp"),
                      memory_reserve_mib=0.0, schedules=schedules, refine_division=False)
        try:
            pruned = search(cost, SearchOptions(**common))
        except NoFeasibleStrategy:
            continue
        every = search(cost, SearchOptions(**common, exhaustive=True))
        assert pruned.summary.iteration_time_s / pruned.strategy.global_batch_size == pytest.approx(
            every.summary.iteration_time_s / every.strategy.global_batch_size, rel=1e-9)


def test_stage_dp_over_chunks_matches_brute_force(make_hw, make_model):
    """An interleaved stage holds several runs of layers: its DP (chunk ends send, chunk starts receive, no transition
    between its chunks) finds the minimum of its objective over every per-layer plan."""
    import numpy as np

    from galva_search.rules import ModelRules
    from galva_search.stages import StageSolver
    from galva_search.tasks import TaskEnumerator

    cost = CostModel(make_hw(4), make_model(8), CostSettings(context_mib=0.0))
    space = SpaceOptions(max_tp=2)
    by_pp: dict = {}
    for c in generate_space(4, space):
        by_pp.setdefault(c.pp, []).append(c)
    options = SearchOptions(memory_budget_mib=1200.0, batch_sizes=(8,), space=space, memory_reserve_mib=0.0,
                            schedules=(INTER,), virtual_stages=(2,))
    tasks = TaskEnumerator(cost, options, by_pp, ModelRules(cost.model, cost.settings, 4))
    counts = {"dp_problems": 0, "dp_reused": 0}
    solver = StageSolver(tasks, 1, counts)
    task = next(t for t in tasks.enumerate() if t.pp == 2 and t.schedule is INTER and t.micro_batches == 4)
    budgets = tasks.stage_budgets(task)
    for stage in range(2):
        key, (intra, memory, inter) = solver.stage_problem(task, stage)
        transient = solver._transients[key]
        L, S = intra.shape
        best = None
        for combo in itertools.product(range(S), repeat=L):
            mem = sum(memory[i, s] for i, s in enumerate(combo)) + max(transient[i, s] for i, s in enumerate(combo))
            if mem > budgets[stage]:
                continue
            t = sum(intra[i, s] for i, s in enumerate(combo)) + sum(
                inter[i, combo[i - 1], s] for i, s in enumerate(combo) if i > 0
            )
            if np.isfinite(t) and (best is None or t < best):
                best = t
        (sols,) = solver.solve([task])
        got = sols[stage]
        if best is None:
            assert got is None
        else:
            assert got is not None and got.time == pytest.approx(best, rel=1e-9)
        # no transition between the stage's two chunks
        assert tasks.layers.stage_chunk_starts(task.division, 2)[stage] == [0, 2]
        assert not inter[2].any() and inter[1].any()


def test_zb_h1_pays_the_split_backward(tiny, tiny_hw):
    """The profile's split_backward_overhead_ms is paid once per layer and micro-batch on every stage that splits
    (all but the first), scaled as compute (kappa); 1F1B and the first stage are untouched."""
    hw = tiny_hw.model_copy(update={"compute_slowdown": 1.5})
    types = tuple(t.model_copy(update={"split_backward_overhead_ms": 4.0}) for t in tiny.layer_types)
    split = tiny.model_copy(update={"layer_types": types})
    plain_cost = CostModel(hw, tiny, CostSettings(context_mib=0.0))
    split_cost = CostModel(hw, split, CostSettings(context_mib=0.0))
    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        plan = _plan(schedule, v)
        same = evaluate_strategy(plain_cost, plan).iteration_time_s
        assert evaluate_strategy(split_cost, plan).iteration_time_s == same
    before = evaluate_strategy(plain_cost, _plan("zb-h1", 1)).detail
    after = evaluate_strategy(split_cost, _plan("zb-h1", 1)).detail
    assert before is not None and after is not None
    assert after.stage_time_s[0] == before.stage_time_s[0]
    assert after.stage_time_s[1] - before.stage_time_s[1] == pytest.approx(2 * 4e-3 * 1.5)  # 2 layers on stage 1
    assert after.stage_parts_s["compute"][1] - before.stage_parts_s["compute"][1] == pytest.approx(2 * 4e-3 * 1.5)
    assert after.iteration_time_s > before.iteration_time_s


def test_ranks_sharing_processors_pay_the_nodes_work_not_the_bubble():
    """4 ranks on 2 processors (slowdown 2): the path at a rank's speed alone (1F1B 7 x 1.5) is shorter than the
    node's work with every rank busy (4 x 3 = 12), and the capacity idle while fewer than 2 ranks can run (fill and
    drain) comes on top: 1F1B 13.5 with F 0.5 and B 1 alone (the simulated steps), interleaved 12.75 and zb-h1
    12.875 (both fill and drain in smaller steps); with slowdown 1.2 the path (1F1B 7 x 2.5) is the longer. The
    search's bound stays below the price."""
    from galva_search.cost_model import SharedProcessors, shared_pipeline_time
    from galva_search.tasks import bound_time

    u, e, w = [3.0] * 4, [0.0] * 4, [0.5] * 4
    shared = SharedProcessors(slowdown=2.0, ranks_per_node=4, stage_size=1)
    for (schedule, v), expected in zip(((ONE, 1), (INTER, 2), (ZB, 1)), (13.5, 12.75, 12.875)):
        t = shared_pipeline_time(u, u, e, 4, shared, schedule, v, w)
        assert t.total == pytest.approx(expected)
        assert t.steady + t.bubble + t.tail == pytest.approx(t.total)
        assert bound_time(u, 4, schedule, v, 2.0, shared) <= t.total + 1e-12
    # with a processor per rank the simulation is the runtime's own schedule simulation (galva_comm.schedules)
    from galva_comm.schedules import schedule_order, simulate
    from galva_search.shared_schedule import shared_schedule_time

    for schedule, v, pp, c in ((ONE, 1, 4, 6), (INTER, 2, 2, 4), (ZB, 1, 3, 5), (PipelineSchedule.GPIPE, 1, 3, 2)):
        f, b, wg = [1.0 + 0.3 * s for s in range(pp)], [2.0 + 0.1 * s for s in range(pp)], [0.7] * pp
        step = {"F": f, "B": b, "I": [x - y for x, y in zip(b, wg)], "W": wg}
        orders = [schedule_order(schedule, s, pp, c, v) for s in range(pp)]
        each = {(s, st): step[st.kind][s] / (1 if st.kind in "IW" else v) for s in range(pp) for st in orders[s]}
        runtime = max(simulate(orders, pp * v, duration=lambda s, st, each=each: each[(s, st)]))
        assert shared_schedule_time(f, b, wg, c, [list(range(pp))], float(pp), schedule, v) == pytest.approx(runtime)
    # time that is not compute (collectives, p2p) takes no processor: 2 stages of 2 ranks, U 3 of which compute 1,
    # take a little over their path (5 x 2.5) where both stages compute at once, not the 20 of all-compute steps
    pairs = SharedProcessors(slowdown=2.0, ranks_per_node=4, stage_size=2)
    assert shared_pipeline_time([3.0, 3.0], [1.0, 1.0], [0.0, 0.0], 4, pairs).total == pytest.approx(79 / 6)
    steps = ([2.5 / 3] * 2, [5 / 3] * 2, [0.0] * 2)
    assert shared_schedule_time(*steps, 4, pairs.node_stages(2), 2.0) == pytest.approx(20.0)
    # slowdown 1.2: the path (1F1B 7 x 2.5, interleaved 4 x 2.5 + 3 x 2.5 / 2) is longer than the busy node (12),
    # and the steps take longer still: with all 4 ranks runnable each gets 1/1.2 of a processor alone
    mild = SharedProcessors(slowdown=1.2, ranks_per_node=4, stage_size=1)
    assert shared_pipeline_time(u, u, e, 4, mild).total == pytest.approx(18.0)
    assert shared_pipeline_time(u, u, e, 4, mild, INTER, 2).total == pytest.approx(15.0)
    # two nodes of 2 ranks, stages of 1: each node holds two stages; the busier node (4 x 5) is not all: its
    # stages 2 and 3 wait for the other node's forwards while the pipeline fills
    two = SharedProcessors(slowdown=2.0, ranks_per_node=2, stage_size=1)
    assert two.node_stages(4) == [[0, 1], [2, 3]]
    assert shared_pipeline_time([3.0, 3.0, 5.0, 5.0], [3.0, 3.0, 5.0, 5.0], e, 4, two).total == pytest.approx(23.5)
    # a node's processors: 2 stages of 2 ranks on 2 processors, one micro-batch, so one stage computes at a time.
    # each of its 2 ranks has a processor and computes at its speed alone (F0 1 + F1 1 + B1 2 + B0 2), not at 0.8
    one = ([1.0, 1.0], [2.0, 2.0], [0.0, 0.0], 1, [[0, 0, 1, 1]], 1.6)
    assert shared_schedule_time(*one) == pytest.approx(6.0 / 0.8)
    assert shared_schedule_time(*one, processors=2) == pytest.approx(6.0)
    assert shared_schedule_time(*one, processors=4) == pytest.approx(6.0 / 0.8)  # a processor per rank: as measured
    # and the closed form's every-rank-busy term: a 2-stage plan of one micro-batch computes on half its ranks at a
    # time, at their speed alone (each has a processor), so its step is the path (1 + 1), not sigma x half of it;
    # the search's bound stays below. One stage, or no processor count: every rank busy, as measured
    sigma = 2.3
    paired = SharedProcessors(slowdown=sigma, ranks_per_node=4, stage_size=2, processors=2)
    assert paired.busy_share(2) == pytest.approx(4 / sigma / 2) and paired.busy_share(1) == 1.0
    unknown = SharedProcessors(slowdown=sigma, ranks_per_node=4, stage_size=2)
    assert unknown.busy_share(2) == 1.0
    u1 = [sigma, sigma]  # all compute: alone 1 each
    assert shared_pipeline_time(u1, u1, [0.0, 0.0], 1, paired).total == pytest.approx(2.0)
    assert shared_pipeline_time(u1, u1, [0.0, 0.0], 1, unknown).total == pytest.approx(sigma)
    assert bound_time(u1, 1, ONE, 1, 2.0, paired) <= 2.0 + 1e-12
    gpipe = ([2.0, 2.0], [0.0, 0.0], [0.0, 0.0], 1, [[0, 0, 0, 1]], 1.6, PipelineSchedule.GPIPE)
    # stage 0's 3 ranks compute at once: capacity 2 + (3 - 2) / (4 - 2) x (1.6 - 2) = 1.8, each rank at 0.6
    assert shared_schedule_time(*gpipe, processors=2) == pytest.approx(2.0 / 0.6 + 2.0)


@pytest.mark.parametrize("processors", [None, 4, 16])
def test_one_device_per_rank_keeps_the_predictions(tiny, tiny_hw, processors):
    """Where no node's ranks outnumber their processors (GPU: one device per rank; None: not measured) every schedule
    is priced by pipeline_time alone, bit for bit; 4 ranks on 2 processors are priced otherwise."""
    hw = tiny_hw.model_copy(update={"processors_per_node": processors, "compute_slowdown": 1.7})
    assert not hw.shares_processors
    cost = CostModel(hw, tiny, CostSettings(context_mib=0.0))
    shared = CostModel(hw.model_copy(update={"processors_per_node": 2}), tiny, CostSettings(context_mib=0.0))
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)):
        got = evaluate_strategy(cost, _plan(schedule, v)).detail
        assert got is not None
        timing = pipeline_time(
            got.stage_time_s, got.stage_exposed_s, 4, PipelineSchedule(schedule), v, got.stage_weight_grad_s
        )
        assert got.iteration_time_s == timing.total + got.optimizer_s
        assert got.bubble_s == timing.bubble
        assert evaluate_strategy(shared, _plan(schedule, v)).iteration_time_s != got.iteration_time_s
