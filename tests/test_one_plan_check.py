"""One answer to "can this plan run on this model": galva-train's command line and galva-hp's ``build`` report the
same problems, all of them (not the first), for bad plans across the model families.

Each case is a real model configuration (a tiny preset, sometimes with changed head counts, saved as a config
directory) and a strategy file. The command line parses ``--model-config DIR --strategy FILE``; ``build`` runs on 4
forked gloo ranks with the same strategy and the Hugging Face model decomposed by galva-models. Both must name every
expected problem and agree word for word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from galva_comm.testing import run_distributed
from galva_models.cli.config import ConfigError, parse_train_config
from galva_models.presets import preset_config
from galva_schema import Strategy

WORLD = 4


def _config(preset: str, **changes: Any) -> Any:
    config = preset_config(preset)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def _plan(layers: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"world_size": WORLD, "global_batch_size": 8, "mixed_precision": "fp32", "layers": layers, **fields}


# name -> (config, strategy fields, sequence length (None: an image model), expected problems)
CASES: dict[str, tuple[Any, dict[str, Any], int | None, list[str]]] = {
    "llama heads and sequence": (
        _config("tiny-llama"),
        _plan([{"tp": 4, "ulysses": True}, {"tp": 4}, {}, {}], megatron_sp=True, vocab={"tp": 4}),
        6,
        [
            "layers[0].tp: Ulysses degree 4 does not divide the sequence of 6 tokens",
            "layers[1].tp: Megatron-SP degree 4 does not divide the sequence of 6 tokens",
            "vocab.tp: Megatron-SP degree 4 does not divide the sequence of 6 tokens",
        ],
    ),
    "qwen2 key/value heads": (
        _config("tiny-qwen2", hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8),
        _plan([{"tp": 2}, {"tp": 4}, {"tp": 4, "ulysses": True}, {}]),
        16,
        [
            "layers[0].tp: tp 2 and the 3 key/value heads of qwen2 layers do not divide one another",
            "layers[1].tp: tp 4 does not divide the 6 attention heads of qwen2 layers",
            "layers[2].tp: Ulysses degree 4 does not divide the 6 attention heads of qwen2 layers",
        ],
    ),
    "mistral heads": (
        _config("tiny-mistral", hidden_size=48, num_attention_heads=6, num_key_value_heads=6, head_dim=8),
        _plan([{"tp": 4}, {"tp": 4}, {"tp": 2}, {}], pp=1),
        16,
        ["layers[0..1].tp: tp 4 does not divide the 6 attention heads of mistral layers"],
    ),
    # attention dropout and GPT-2's per-layer attention scaling run in every form (the family's own attention runs
    # in place since GPT-2 moved to its table): only the learned positions bound the plan
    "gpt2 attention scaling and positions": (
        _config("tiny-gpt2", attn_pdrop=0.1, scale_attn_by_inverse_layer_idx=True),
        _plan([{"tp": 2}, {"tp": 2, "ulysses": True}, {}, {}]),
        512,
        ["seq_len: 512 exceeds the model's 256 learned positions"],
    ),
    "bert heads": (
        _config("tiny-bert", num_attention_heads=2),
        _plan([{"tp": 4}, {}, {"tp": 4, "ulysses": True}, {}]),
        16,
        [
            "layers[0].tp: tp 4 does not divide the 2 attention heads",
            "layers[2].tp: Ulysses degree 4 does not divide the 2 attention heads",
        ],
    ),
    "t5 forms, vocabulary and shared tables": (
        _config("tiny-t5"),
        _plan(
            [{"tp": 2, "ulysses": True, "dp_type": "zero3"}, {"tp": 2}, {}, {}],
            pp=2,
            pp_division=[1, 3],
            vocab={"tp": 2},
        ),
        8,
        # Ulysses, ZeRO-3 and a stack over two stages with two tp layouts run (the tables are galva-hp shared
        # parameters): the vocabulary is the one problem
        ["vocab.tp: the vocabulary cannot run vocabulary tensor parallelism"],
    ),
    "t5 megatron-sp": (  # the boundary holds encoder and decoder: 7 + 7 tokens, which 4 does not divide
        _config("tiny-t5"),
        _plan([{"tp": 4}] * 4, megatron_sp=True),
        7,
        ["Megatron-SP degree 4 does not divide the sequence of 14 tokens"],
    ),
    "vit vocabulary and heads": (
        _config("tiny-vit", num_attention_heads=2),
        _plan([{"tp": 4}, {}], vocab={"tp": 2, "sp": True}),  # image models run vocab tp, not vocab sp
        None,
        ["layers[0].tp: tp 4 does not divide the 2 attention heads", "vocab.sp: the vocabulary cannot run"],
    ),
    "swin grid": (  # its layers take the whole patch grid: no sequence form, whatever the degree
        _config("tiny-swin", image_size=24),
        _plan([{"tp": 2, "ulysses": True}] * 4, vocab={"tp": 2, "sp": True}),
        None,
        [
            "layers[1].ulysses: swin_stage1 layers cannot run Ulysses: swin's layers arrange their 36 tokens as a grid",
            "vocab.sp: the vocabulary cannot run",
        ],
    ),
    "fp16 and world": (
        _config("tiny-llama"),
        _plan([{}] * 4, world_size=2, mixed_precision="fp16", global_batch_size=2),
        16,
        [
            "world_size: the strategy has 2 ranks but the run has 4",
            "mixed_precision: fp16 needs loss scaling",
        ],
    ),
}


def _layer_count(config: Any) -> int:
    from galva_models import adapter_for

    return adapter_for(config).constraints(config).num_layers


def _strategy(case: str) -> Strategy:
    config, fields, _, _ = CASES[case]
    layers = fields["layers"]
    count = _layer_count(config)
    if len(layers) != count:  # presets differ in depth: repeat the last entry (division given explicitly stays)
        layers = [*layers, *[layers[-1]] * (count - len(layers))][:count]
    return Strategy.model_validate({**fields, "layers": layers})


def _cli_message(case: str, tmp_path: Path) -> str:
    config, _, seq, _ = CASES[case]
    directory = tmp_path / case.replace(" ", "_").replace(",", "")
    config.save_pretrained(str(directory))
    plan = _strategy(case).save(directory / "plan.json")
    argv = ["--model-config", str(directory), "--strategy", str(plan)]
    argv += ["--seq-length", str(seq)] if seq is not None else []
    with pytest.raises(ConfigError) as info:
        parse_train_config(argv, world_size=WORLD)
    message = str(info.value)
    assert "\n" not in message
    return message.removeprefix(f"{plan}: ")


def _build_messages(rank: int, world_size: int) -> dict[str, str]:
    from galva_hp import BuildOptions, build
    from galva_models import build_layered
    from galva_schema import SchemaError

    out = {}
    for case, (config, _, seq, _) in CASES.items():
        options = {"encoder_seq_length": seq} if config.model_type == "t5" else {}
        _, layered = build_layered(config, **options)
        try:
            build(layered, _strategy(case), BuildOptions(seq_len=seq))
            out[case] = "built"
        except SchemaError as err:
            out[case] = err.detail
    return out


@pytest.mark.distributed
def test_cli_and_build_report_every_problem_in_the_same_words(tmp_path: Path) -> None:
    from_build = run_distributed(_build_messages, WORLD, timeout=240)
    assert all(messages == from_build[0] for messages in from_build)
    for case, (_, _, _, expected) in CASES.items():
        from_cli = _cli_message(case, tmp_path)
        assert from_cli == from_build[0][case], case
        missing = [problem for problem in expected if problem not in from_cli]
        assert not missing, (case, missing, from_cli)
