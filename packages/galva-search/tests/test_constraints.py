"""The search never plans what the model refuses: constraints carried by the model profile, checked with
galva_schema.plan_problems (heads, unsupported forms, sequence sharding, shared parameters, vocabulary forms)."""

from __future__ import annotations

import pytest

from galva_schema import (
    DataParallelType,
    LayerTypeConstraints,
    ModelConstraints,
    ModelProfile,
    ParallelForm,
    SchemaError,
    SharedParameter,
    Strategy,
    plan_problems,
)
from galva_search.cli import main
from galva_search.cost_model import CostModel, CostSettings
from galva_search.rules import ModelRules
from galva_search.search import NoFeasibleStrategy, SearchOptions, search
from galva_search.space import Candidate, SpaceOptions

ENCODER, DECODER = 3, 5  # an even split of 8 layers over 2 stages (4 | 4) puts the decoder's shared table on both
# 1850: the unconstrained search picks Ulysses there (1750 did before the ZeRO-3 gather and recomputation
# transients were set aside from each stage's budget, docs/cost-model.md §4)
# the budgets below were chosen for the reference's bytes per parameter; these tests are about constraints
SETTINGS = CostSettings(context_mib=0.0, state_accounting="reference")
BUDGETS = (950.0, 1000.0, 1150.0, 1200.0, 1300.0, 1450.0, 1750.0, 1850.0, 2400.0, 4000.0)
REFUSED = {
    ParallelForm.ULYSSES: "relative attention bias is computed over the whole sequence",
    ParallelForm.MEGATRON_SP: "no sequence-parallel T5 block",
    ParallelForm.ZERO3: "the relative-position table is shared by every layer of a stack",
}


def t5_constraints(num_heads: int = 4) -> ModelConstraints:
    return ModelConstraints(
        model_name="t5-like",
        layer_types=(
            LayerTypeConstraints(name="t5_encoder", num_layers=ENCODER, num_heads=num_heads, unsupported=REFUSED),
            LayerTypeConstraints(name="t5_decoder", num_layers=DECODER, num_heads=num_heads, unsupported=REFUSED),
        ),
        vocab_unsupported={
            ParallelForm.VOCAB_TP: "tied embedding and head",
            ParallelForm.VOCAB_SP: "no sequence-parallel head",
            ParallelForm.ZERO3: "tied embedding and head",
        },
        shared_parameters=(
            SharedParameter(name="encoder relative-position table", layers=(0, ENCODER - 1)),
            SharedParameter(name="decoder relative-position table", layers=(ENCODER, ENCODER + DECODER - 1)),
        ),
    )


def t5_profile(make_model, constraints: ModelConstraints | None, *, megatron_sp: bool = False) -> ModelProfile:
    """Encoder and decoder types of the tiny model, with activation entries up to tp 8 and the vocabulary's."""
    data = make_model(megatron_sp=megatron_sp).to_dict()
    layer = {**data["layer_types"][0], "activation_mib_per_sample": {"1": 10.0, "2": 6.0, "4": 4.0, "8": 3.0}}
    data["layer_types"] = [
        {**layer, "name": "t5_encoder", "num_layers": ENCODER},
        {**layer, "name": "t5_decoder", "num_layers": DECODER, "parameter_mib": 96.0},
    ]
    vocab = {
        "model_states_mib": {"1": 400.0, "2": 200.0, "4": 100.0, "8": 50.0},
        "activation_mib_per_sample": {"1": 40.0, "2": 20.0, "4": 10.0, "8": 5.0},
    }
    for position in ("memory_pp_off", "memory_pp_first", "memory_pp_last"):
        data["vocab"][position] = vocab
    data["model_name"] = "t5-like"
    data["constraints"] = None if constraints is None else constraints.model_dump(mode="json")
    return ModelProfile.from_dict(data)


def plan(cost: CostModel, budget: float) -> Strategy | None:
    options = SearchOptions(
        memory_budget_mib=budget,
        batch_sizes=(8, 16, 32),
        space=SpaceOptions(sp_space="tp+sp"),
        memory_reserve_mib=0.0,
    )
    try:
        return search(cost, options).strategy
    except NoFeasibleStrategy:
        return None


def test_constrained_search_never_plans_a_refused_form(make_hw, make_model):
    cost = CostModel(make_hw(8), t5_profile(make_model, t5_constraints()), SETTINGS)
    plans = [s for s in (plan(cost, b) for b in BUDGETS) if s is not None]
    assert len(plans) >= 5
    for s in plans:
        assert plan_problems(s, t5_constraints(), world_size=8, seq_len=512) == []
        assert not any(layer.ulysses for layer in s.layers)
        assert all(s.layer_dp_type(i) is not DataParallelType.ZERO3 for i in range(s.num_layers))
        assert all(4 % layer.tp == 0 for layer in s.layers)  # tp 8 does not divide 4 heads
        assert s.vocab.tp == 1 and s.vocab_dp_type is not DataParallelType.ZERO3
    assert any(s.pp > 1 for s in plans)  # a pipelined plan was checked too
    assert any(layer.tp > 1 for s in plans for layer in s.layers)  # tp itself stays available


def test_the_same_profile_without_constraints_plans_refused_forms(make_hw, make_model):
    """The constrained test above can fail: without the constraints the search does pick refused forms here."""
    cost = CostModel(make_hw(8), t5_profile(make_model, None), SETTINGS)
    problems = [p for b in BUDGETS if (s := plan(cost, b)) for p in plan_problems(s, t5_constraints(), seq_len=512)]
    assert any("cannot run ZeRO-3" in p for p in problems)
    assert any("cannot run Ulysses" in p for p in problems)


def test_megatron_sp_refused_leaves_only_tp_1(make_hw, make_model):
    model = t5_profile(make_model, t5_constraints(), megatron_sp=True)
    cost = CostModel(make_hw(8), model, CostSettings(context_mib=0.0, megatron_sp=True))
    plans = [s for s in (plan(cost, b) for b in BUDGETS) if s is not None]
    assert plans
    for s in plans:
        assert all(layer.tp == 1 for layer in s.layers) and s.vocab.tp == 1
        assert plan_problems(s, t5_constraints(), world_size=8, seq_len=512) == []
    unconstrained = CostModel(make_hw(8), t5_profile(make_model, None, megatron_sp=True), cost.settings)
    assert any(layer.tp > 1 for b in BUDGETS if (s := plan(unconstrained, b)) for layer in s.layers)


def test_heads_and_sequence_decide_the_degrees(make_hw, make_model):
    """Two heads: tp 4 and 8 are refused; Ulysses is allowed (constraints without refusals) only where its degree
    divides the heads; at the type's last layer the output sequence must split too."""
    base = t5_constraints(num_heads=2)
    types = tuple(t.model_copy(update={"unsupported": {}}) for t in base.layer_types)
    types = (types[0].model_copy(update={"output_seq_length": 509}), types[1])  # 509 tokens: no split divides it
    constraints = base.model_copy(update={"layer_types": types, "shared_parameters": ()})
    cost = CostModel(make_hw(8), t5_profile(make_model, constraints), SETTINGS)
    rules = ModelRules(cost.model, cost.settings, 8)
    cands = [
        Candidate(1, tp, 8 // tp, True, DataParallelType.DDP, ulysses)
        for tp in (1, 2, 4)
        for ulysses in ((False, True) if tp > 1 else (False,))
    ]
    assert rules.allowed(1, cands, False).tolist() == [True, True, True, False, False]
    assert rules.allowed(0, cands, True).tolist() == [
        True,
        True,
        False,
        False,
        False,
    ]  # Ulysses 2 cannot split 509 output tokens
    for budget in BUDGETS:
        s = plan(cost, budget)
        if s is not None:
            assert plan_problems(s, constraints, world_size=8, seq_len=512) == []


def test_shared_parameters_restrict_no_partition_or_layout(make_hw, make_model):
    """galva-hp gives every rank that runs a reader of a shared parameter a copy and sums its gradient over them
    (galva_hp.shared_params): a plan may cut a shared run over stages and give its layers different tp layouts, and
    the search plans such divisions as it plans any other."""
    layers = [{"tp": 2}] * 4 + [{"tp": 1}, {"tp": 2, "tp_consecutive": False}, {"tp": 4}, {"tp": 2}]
    split = {"world_size": 8, "pp": 2, "pp_division": [4, 4], "global_batch_size": 8, "layers": layers}
    assert plan_problems(Strategy.model_validate(split), t5_constraints(), world_size=8, seq_len=512) == []
    cost = CostModel(make_hw(8), t5_profile(make_model, t5_constraints()), SETTINGS)
    rules = ModelRules(cost.model, cost.settings, 8)
    assert not any(hasattr(rules, name) for name in ("cuts_shared", "snap", "tied"))


def test_a_model_no_plan_can_run_is_a_one_line_error(make_hw, make_model):
    cost = CostModel(
        make_hw(8),
        t5_profile(make_model, t5_constraints()),
        CostSettings(default_dp_type=DataParallelType.ZERO3),
        model_source="t5.json",
    )
    with pytest.raises(SchemaError, match=r"^t5.json: constraints: no plan can run this model: .*cannot run ZeRO-3"):
        search(cost, SearchOptions(memory_budget_mib=4000.0, batch_sizes=(8,)))


def test_cli_reads_constraints_from_the_model_profile(make_hw, make_model, tmp_path):
    hw_path, model_path, out = tmp_path / "hw.json", tmp_path / "t5.json", tmp_path / "strategy.json"
    make_hw(8).save(hw_path)
    t5_profile(make_model, t5_constraints()).save(model_path)
    for memory in ("1000MiB", "1200MiB", "2400MiB"):
        code = main(
            [
                "--hardware-profile",
                str(hw_path),
                "--model-profile",
                str(model_path),
                "--memory",
                memory,
                "--memory-reserve",
                "0",
                "--context-memory",
                "0MiB",
                "--global-batch-size",
                "16",
                "--sp-space",
                "tp+sp",
                "--quiet",
                "--output",
                str(out),
            ]
        )
        assert code == 0
        assert plan_problems(Strategy.load(out), t5_constraints(), world_size=8, seq_len=512) == []


def test_a_profile_without_entries_for_refused_tp_degrees_still_plans(make_hw, make_model):
    """A model whose constraints refuse tp (e.g. GPT-2 with attention dropout) is profiled at tp 1 only: the search
    must not ask for the tp entries nobody measured, and plans tp 1 (or Ulysses where allowed)."""
    no_tp = {ParallelForm.TP: "attn_pdrop: parallel attention has no attention dropout"}
    constraints = ModelConstraints(
        model_name="gpt2-like",
        layer_types=(
            LayerTypeConstraints(name="t5_encoder", num_layers=ENCODER, num_heads=4, unsupported=no_tp),
            LayerTypeConstraints(name="t5_decoder", num_layers=DECODER, num_heads=4, unsupported=no_tp),
        ),
    )
    data = t5_profile(make_model, constraints).to_dict()
    for layer_type in data["layer_types"]:
        layer_type["activation_mib_per_sample"] = {"1": 10.0}
    cost = CostModel(make_hw(8), ModelProfile.from_dict(data), SETTINGS)
    strategy = plan(cost, 4000.0)
    assert strategy is not None
    assert all(layer.tp == 1 or layer.ulysses for layer in strategy.layers)
    assert plan_problems(strategy, constraints) == []
    # without constraints the same profile is an error that names the missing entry, as before
    data["constraints"] = None
    with pytest.raises(SchemaError, match="no entry for tp 2"):
        plan(CostModel(make_hw(8), ModelProfile.from_dict(data), cost.settings), 4000.0)
