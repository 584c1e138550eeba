"""plan_problems: every reason a plan cannot run on a model, one line each, grouped over layers."""

from __future__ import annotations

import pytest

from galva_schema import (
    LayerTypeConstraints,
    ModelConstraints,
    ModelProfile,
    ParallelForm,
    SchemaError,
    SharedParameter,
    Strategy,
    plan_problems,
)
from galva_schema.constraints import uniform_constraints
from galva_schema.sharding import contiguous_block, sequence_shards


def plan(layers: list[dict], **fields) -> Strategy:
    fields.setdefault("world_size", 8)
    fields.setdefault("global_batch_size", 8)
    return Strategy.model_validate({"layers": layers, **fields})


LLAMA = uniform_constraints("llama-gqa", "llama", 4, num_heads=12, num_kv_heads=3, max_seq_length=64)

# an encoder-decoder whose stacks each share a table, with forms it lacks
SEQ2SEQ = ModelConstraints(
    model_name="t5-like",
    layer_types=(
        LayerTypeConstraints(
            name="encoder",
            num_layers=2,
            num_heads=4,
            seq_length=24,
            unsupported={ParallelForm.ULYSSES: "a slice would cut [enc; dec]", ParallelForm.ZERO3: "shared table"},
        ),
        LayerTypeConstraints(name="decoder", num_layers=2, num_heads=4, seq_length=24),
    ),
    vocab_unsupported={ParallelForm.VOCAB_TP: "not written yet"},
    shared_parameters=(SharedParameter(name="encoder table", layers=(0, 1)),),
)

# an image model whose first stage merges 36 tokens into 9
IMAGE = ModelConstraints(
    model_name="swin-like",
    layer_types=(
        LayerTypeConstraints(name="stage0", num_layers=2, num_heads=2, seq_length=36, output_seq_length=9),
        LayerTypeConstraints(name="stage1", num_layers=2, num_heads=4, seq_length=9),
    ),
)


def test_a_runnable_plan_has_no_problems() -> None:
    layers = [{"tp": 6}, {"tp": 3, "ulysses": False}, {"tp": 2, "ulysses": True}, {"tp": 1}]
    assert plan_problems(plan(layers, world_size=12, global_batch_size=12), LLAMA, seq_len=24) == []


def test_every_problem_is_reported_not_only_the_first() -> None:
    strategy = plan(
        [{"tp": 8}, {"tp": 2}, {"tp": 8, "ulysses": True}, {"tp": 8}],
        megatron_sp=True,
        mixed_precision="fp16",
        vocab={"tp": 8},
    )
    assert plan_problems(strategy, LLAMA, world_size=4, seq_len=100) == [
        "world_size: the strategy has 8 ranks but the run has 4",
        "mixed_precision: fp16 needs loss scaling, which Galva does not do; use bf16 or fp32",
        "seq_len: 100 exceeds the model's 64 learned positions",
        "layers[0,3].tp: tp 8 does not divide the 12 attention heads of llama layers",
        "layers[0,3].tp: Megatron-SP degree 8 does not divide the sequence of 100 tokens",
        "layers[1].tp: tp 2 and the 3 key/value heads of llama layers do not divide one another",
        "layers[2].tp: Ulysses degree 8 does not divide the 12 attention heads of llama layers",
        "layers[2].tp: Ulysses degree 8 does not divide the sequence of 100 tokens",
        "vocab.tp: Megatron-SP degree 8 does not divide the sequence of 100 tokens",
    ]


def test_unsupported_forms_shared_parameters_and_vocab() -> None:
    strategy = plan(
        [{"tp": 2, "ulysses": True, "dp_type": "zero3"}, {"tp": 4}, {}, {}],
        pp=2,
        pp_division=[1, 3],
        vocab={"tp": 2},
    )
    assert plan_problems(strategy, SEQ2SEQ, seq_len=12) == [
        "layers[0].ulysses: encoder layers cannot run Ulysses: a slice would cut [enc; dec]",
        "layers[0].dp_type: encoder layers cannot run ZeRO-3: shared table",
        "vocab.tp: the vocabulary cannot run vocabulary tensor parallelism: not written yet",
    ]  # the shared encoder table restricts nothing: its layers sit on two stages with two tp layouts (galva-hp)


def test_sequence_lengths_of_the_layer_and_of_its_output() -> None:
    # Ulysses 2 splits stage0's 36 tokens, but not the 9 its last layer outputs, nor stage1's 9 inputs
    strategy = plan([{"tp": 2, "ulysses": True}] * 4, world_size=2, global_batch_size=2)
    assert plan_problems(strategy, IMAGE) == [
        "layers[1].tp: Ulysses degree 2 does not divide the 9 tokens of its output",
        "layers[2..3].tp: Ulysses degree 2 does not divide the sequence of 9 tokens",
    ]
    assert plan_problems(plan([{"tp": 2}] * 4, world_size=2, global_batch_size=2), IMAGE) == []


def test_layer_count_mismatch_stops_per_layer_checks() -> None:
    assert plan_problems(plan([{"tp": 8}] * 3), LLAMA) == ["layers: the strategy has 3 layers but llama-gqa has 4"]


def test_constraints_travel_in_a_model_profile(tmp_path) -> None:

    profile = _profile(("decoder", 2))
    constraints = uniform_constraints("m", "decoder", 2, num_heads=4)
    with_constraints = ModelProfile.model_validate({**profile.to_dict(), "constraints": constraints.model_dump()})
    with_constraints.save(tmp_path / "profile.json")
    assert ModelProfile.load(tmp_path / "profile.json").constraints == constraints
    wrong = uniform_constraints("m", "encoder", 2, num_heads=4)
    with pytest.raises(SchemaError, match=r"constraints: layer types \(name, count\)"):
        ModelProfile.from_dict({**profile.to_dict(), "constraints": wrong.model_dump(mode="json")})


def test_sharding_rules() -> None:
    assert [sequence_shards(4, ulysses=u, megatron_sp=m) for u in (False, True) for m in (False, True)] == [1, 4, 4, 4]
    assert sequence_shards(1, ulysses=False, megatron_sp=True) == 1
    assert contiguous_block(8, 4, 3) == slice(6, 8)
    with pytest.raises(ValueError, match="a batch of 6 samples cannot be split into 4 equal parts"):
        contiguous_block(6, 4, 0)
    strategy = plan(
        [{"tp": 2, "ulysses": True}, {"tp": 2}, {}, {}], megatron_sp=True, global_batch_size=32, num_micro_batches=4
    )
    assert [strategy.layer_sequence_shards(i) for i in range(4)] == [2, 2, 1, 1]


def _profile(*types: tuple[str, int]) -> ModelProfile:
    layer = {
        "hidden_size": 64,
        "seq_length": 16,
        "forward_time": {"form": "static", "ms_per_sample": 1.0},
        "parameter_mib": 1.0,
        "activation_mib_per_sample": {"1": 1.0},
        "checkpoint_activation_mib_per_sample": 0.1,
    }
    memory = {"model_states_mib": {"1": 1.0}, "activation_mib_per_sample": {"1": 1.0}}
    return ModelProfile.model_validate(
        {
            "model_name": "m",
            "precision": "bf16",
            "layer_types": [{"name": name, "num_layers": n, **layer} for name, n in types],
            "vocab": {
                "forward_time": {"form": "static", "ms_per_sample": 1.0},
                "memory_pp_off": memory,
                "memory_pp_first": memory,
                "memory_pp_last": memory,
            },
        }
    )


def test_context_parallelism_is_checked_by_the_one_function() -> None:
    """cp is opt-in (a model whose attention has no ring refuses it, naming the model); a family may refuse it with
    its reason; the sequence must cut into 2 x cp chunks (x the sequence shards); tp x cp must divide a stage."""
    cp2 = plan([{"cp": 2}] * 4, world_size=4, vocab={"cp": 2})
    assert cp2.layer_dp(0) == 2 and cp2.vocab_dp == 2 and cp2.layer_summary(0) == "1-1-2-cp2"
    problems = plan_problems(cp2, LLAMA, seq_len=32)
    assert problems == [
        "layers[0..3].cp: llama layers cannot run context parallelism: llama-gqa's attention has no ring form "
        "(its adapter does not run it)",
        "vocab.cp: the vocabulary cannot run context parallelism: llama-gqa's attention has no ring form "
        "(its adapter does not run it)",
    ]
    ring = LLAMA.model_copy(update={"context_parallel": True})
    assert plan_problems(cp2, ring, seq_len=32) == []
    assert plan_problems(cp2, ring, seq_len=34) == [
        "layers[0..3].cp: the sequence of 34 tokens does not divide into 4 equal chunks (2 x cp 2)",
        "vocab.cp: the sequence of 34 tokens does not divide into 4 equal chunks (2 x cp 2)",
    ]
    sp = plan([{"cp": 2, "tp": 3}] * 4, world_size=6, megatron_sp=True, global_batch_size=6)
    three = uniform_constraints("m", "m", 4, num_heads=6, num_kv_heads=3, context_parallel=True)
    assert plan_problems(sp, three, seq_len=18) == [
        "layers[0..3].cp: the sequence of 18 tokens does not divide into 12 equal chunks (2 x cp 2 x 3 sequence shards)"
    ]
    refused = uniform_constraints(
        "gemma2", "gemma2", 4, 4, unsupported={ParallelForm.CP: "soft-capped scores"}, context_parallel=True
    )
    assert plan_problems(cp2, refused, seq_len=32)[0] == (
        "layers[0..3].cp: gemma2 layers cannot run context parallelism: soft-capped scores"
    )
    with pytest.raises(ValueError, match=r"layers\[0\].cp: tp 2 x cp 4 is more than the 4 ranks"):
        plan([{"tp": 2, "cp": 4}] + [{}] * 3, world_size=4)


def test_expert_layout_rules_one_line_each() -> None:
    """ep divides the experts, etp the expert FFN, ep x etp the stage; dense layers of a model with experts ignore
    the expert fields; a model without experts refuses them."""
    moe = ModelConstraints(
        model_name="deepseek_v3",
        layer_types=(
            LayerTypeConstraints(name="dense", num_layers=1, num_heads=4),
            LayerTypeConstraints(name="moe", num_layers=3, num_heads=4, num_experts=6, expert_ffn=10),
        ),
    )

    def plan(**layer: object) -> Strategy:
        return Strategy.uniform(world_size=4, num_layers=4, global_batch_size=8, layer=dict(layer))

    assert plan_problems(plan(ep=2, etp=2), moe) == []
    assert plan_problems(plan(ep=2), moe) == []
    assert plan_problems(plan(ep=4), moe) == ["layers[1..3].ep: ep 4 does not divide the 6 experts of moe layers"]
    assert plan_problems(plan(etp=4), moe) == [
        "layers[1..3].etp: etp 4 does not divide the expert FFN (size 10) of moe layers"
    ]
    assert plan_problems(plan(tp=2, ep=2), moe, seq_len=15) == [
        "layers[1..3].tp: tp 2 does not divide the sequence of 15 tokens (each tp rank routes its slice of them to "
        "the experts)"
    ]
    dense = uniform_constraints("llama", "llama", 4, 4)
    assert plan_problems(plan(ep=2), dense) == ["layers[0..3].ep: llama has no expert layers"]
    with pytest.raises(ValueError, match=r"layers\[0..3\].ep: ep x etp = 4 x 2 does not divide the 4 ranks"):
        plan(ep=4, etp=2)
    mixed = plan(ep=2, expert_dp_type="zero3")
    assert mixed.layer_expert_dp(1) == 2 and mixed.layer_expert_dp_type(1).value == "zero3"
    assert plan(ep=2).layer_expert_dp_type(0) is plan(ep=2).layer_dp_type(0)
