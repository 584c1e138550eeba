"""top_plans: the N fastest distinct plans, the first being search()'s own, ranked by predicted throughput."""

from __future__ import annotations

import pytest

from galva_search.cost_model import CostModel, CostSettings
from galva_search.search import SearchOptions, evaluate_strategy, search
from galva_search.space import SpaceOptions
from galva_search.top import top_plans


def test_top_plans_are_distinct_ranked_and_start_with_the_search_answer(make_hw, make_model):
    cost = CostModel(make_hw(4), make_model(4), CostSettings(context_mib=0.0))
    options = SearchOptions(memory_budget_mib=4000.0, batch_sizes=(8,), space=SpaceOptions(sp_space="tp+sp"),
                            memory_reserve_mib=0.0)
    best = search(cost, options)
    plans = top_plans(cost, options, 5)
    assert len(plans) == 5
    assert plans[0].strategy == best.strategy
    keys = {p.strategy.model_dump_json(exclude={"description"}) for p in plans}
    assert len(keys) == 5
    throughputs = [p.throughput_samples_per_s for p in plans]
    assert throughputs == sorted(throughputs, reverse=True)
    for plan in plans:  # every plan is scored as evaluate_strategy scores it, and fits
        got = evaluate_strategy(cost, plan.strategy)
        assert got.iteration_time_s == pytest.approx(plan.iteration_time_s, rel=1e-9)
        assert max(plan.stage_memory_mib) <= options.usable_mib + 1e-6
    # pruning keeps the same ranking as solving every task
    every = top_plans(cost, SearchOptions(**{**options.__dict__, "exhaustive": True}), 5)
    assert [p.throughput_samples_per_s for p in every] == pytest.approx(throughputs, rel=1e-12)
    assert top_plans(cost, options, 1)[0].strategy == best.strategy
    with pytest.raises(ValueError):
        top_plans(cost, options, 0)
