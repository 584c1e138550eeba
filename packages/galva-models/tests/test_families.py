"""Every family: LayeredModel.reference_loss equals the Hugging Face model's own loss on the same weights.

Tiny configs, fp32, CPU, eval mode (no dropout). Tolerance 1e-6 absolute on the mean loss; the gradients of one
backward pass agree within 1e-5 (same weights, same maths, different summation order at most).
"""

from __future__ import annotations

import re

import pytest
import torch

from galva_models import adapter_for, build_layered, parameter_name_map
from galva_models.presets import preset_config
from galva_models.tables.family import galva_named_parameters, shared_parameter_groups

B, S = 2, 12


def _lm_batch(vocab: int, gen: torch.Generator):
    ids = torch.randint(0, vocab, (B, S), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)  # what HF's shifted loss scores
    return ids, labels


def _case(family: str, model, gen: torch.Generator):
    """(HF loss, Galva inputs, Galva labels) for one batch."""
    cfg = model.config
    if family in {"gpt2", "llama", "mistral", "qwen2"}:
        ids, labels = _lm_batch(cfg.vocab_size, gen)
        return model(input_ids=ids, labels=ids).loss, ids, labels
    if family == "bert":
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        labels = torch.where(torch.rand(B, S, generator=gen) < 0.3, ids, torch.full_like(ids, -100))
        labels[:, 0] = ids[:, 0]
        return model(input_ids=ids, labels=labels).loss, ids, labels
    if family == "t5":
        enc = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
        labels = torch.randint(1, cfg.vocab_size, (B, 7), generator=gen)
        inputs = torch.cat([enc, model._shift_right(labels)], dim=1)
        return model(input_ids=enc, labels=labels).loss, inputs, labels
    pixels = torch.randn(B, cfg.num_channels, cfg.image_size, cfg.image_size, generator=gen)
    labels = torch.randint(0, cfg.num_labels, (B,), generator=gen)
    return model(pixel_values=pixels, labels=labels).loss, pixels, labels


FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "bert", "t5", "vit", "swin"]


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_loss_equals_hugging_face(family):
    torch.manual_seed(0)
    config = preset_config(f"tiny-{family}")
    options = {"encoder_seq_length": S} if family == "t5" else {}
    model, layered = build_layered(config, **options)
    model.eval()
    gen = torch.Generator().manual_seed(1)
    hf_loss, inputs, labels = _case(family, model, gen)
    ours = layered.reference_loss(inputs, labels)
    assert abs(ours.item() - hf_loss.item()) < 1e-6, (ours.item(), hf_loss.item())

    # one backward: same gradients on every parameter
    hf_loss.backward()
    hf_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    layered.reference_loss(inputs, labels).backward()
    names = parameter_name_map(model, layered)
    for galva_name, param in galva_named_parameters(layered):
        hf_name = names[galva_name]
        if hf_name in hf_grads:
            torch.testing.assert_close(param.grad, hf_grads[hf_name], atol=1e-5, rtol=0, msg=galva_name)


def test_qwen2_has_qkv_bias_and_llama_gqa():
    _, qwen = build_layered(preset_config("tiny-qwen2"))
    assert qwen.layers[0].layer.self_attn.q_proj.bias is not None
    _, llama = build_layered(preset_config("tiny-llama"))
    attn = llama.layers[0].layer.self_attn
    assert attn.k_proj.out_features * 2 == attn.q_proj.out_features  # 4 query heads, 2 kv heads


def test_name_mapping_and_tied_weights():
    model, layered = build_layered(preset_config("tiny-gpt2"))
    names = parameter_name_map(model, layered)  # in place: Hugging Face's names under each Galva module's prefix
    assert names["embedding.wte.weight"] == "transformer.wte.weight"
    assert names["layers.3.layer.attn.c_attn.weight"] == "transformer.h.3.attn.c_attn.weight"
    assert names["head.ln_f.weight"] == "transformer.ln_f.weight"
    (tie,) = layered.shared  # the tie: one shared weight, at home in the embedding, held in place by the head
    assert (tie.record_name, tie.held) == ("embedding.wte.weight", {"head": "lm_head.weight"})
    assert len(set(names.values())) == sum(1 for _ in model.parameters())  # every HF parameter, once
    model, layered = build_layered(preset_config("tiny-llama"))
    assert layered.shared == [] and parameter_name_map(model, layered)["head.lm_head.weight"] == "lm_head.weight"


def test_layer_types_and_specs():
    config = preset_config("tiny-swin")
    _, layered = build_layered(config)
    assert layered.layer_types == ["swin_stage0", "swin_stage1", "swin_stage2", "swin_stage2", "swin_stage3"]
    specs = adapter_for(config).layer_specs(config, 0)
    assert [(s.seq_length, s.hidden_size) for s in specs][:2] == [(256, 16), (64, 32)]
    t5 = preset_config("tiny-t5")
    _, layered = build_layered(t5, encoder_seq_length=8)
    assert layered.layer_types == ["t5_encoder"] * 2 + ["t5_decoder"] * 2
    # each stack's relative-position table is a parameter of its first layer only, declared a galva-hp shared
    # parameter that every layer of the stack reads through its bias
    assert shared_parameter_groups(layered) == [("embedding.shared.weight", "head.lm_head.weight")]
    table = layered.layers[0].layer.layer[0].SelfAttention.relative_attention_bias.weight
    assert (layered.shared[0].param is table, layered.shared[0].home, layered.shared[0].users) == (
        True, "layers.0", ("layers.0", "layers.1")
    )
    assert layered.shared[2].held == {"head": "lm_head.weight"}  # the tie, one mechanism with the tables
    assert layered.layers[1].bias.table is layered.shared[0] and layered.layers[3].bias.table is layered.shared[1]
    assert not any("relative_attention_bias" in n for n, _ in layered.layers[1].named_parameters())


def test_swin_refuses_the_sequence_forms_before_building():
    """Swin's layers arrange their tokens as a grid of windows (and merge patches) outside the attention function:
    Ulysses is refused by galva-hp's check, before any process group, naming the layers and why; tp alone and tp
    with Megatron-SP (its hook beside the table entry) are fine."""
    from galva_hp import check_plan
    from galva_schema import SchemaError, Strategy

    _, layered = build_layered(preset_config("tiny-swin"))

    def plan(**fields) -> Strategy:
        layer = fields.pop("layer")
        base = {"world_size": 2, "pp": 1, "global_batch_size": 2, "num_micro_batches": 1}
        return Strategy.model_validate({**base, "layers": [layer] * layered.num_layers, **fields})

    check_plan(layered, plan(layer={"tp": 2}))
    message = "layers[0].{}: swin_stage0 layers cannot run {}: swin's layers arrange their 256 tokens as a grid"
    with pytest.raises(SchemaError, match=re.escape(message.format("ulysses", "Ulysses"))):
        check_plan(layered, plan(layer={"tp": 2, "ulysses": True}))
    check_plan(layered, plan(layer={"tp": 2}, megatron_sp=True))


def test_unknown_model_type():
    expected = "model_type 'mamba' has no Galva adapter: supported are bert, gpt2, swin, t5, vit"
    with pytest.raises(ValueError, match=expected):
        adapter_for("mamba")


def test_families_with_tables_need_no_adapter():
    """llama, mistral and qwen2 are run from transformers' own tables, like every causal LM that has them; GPT-2 from
    Galva's table for it."""
    from galva_models import tables

    for family in ("gpt2", "llama", "mistral", "qwen2", "gemma2", "phi3"):
        assert adapter_for(family) is tables.ADAPTER
        assert adapter_for(preset_config(f"tiny-{family}")) is tables.ADAPTER


@pytest.mark.parametrize(
    ("family", "message"),
    [
        ("hrm_text", "HrmTextModel has no 'layers', which its pipeline table names as its layers"),
        ("deepseek_v4", "deepseek_v4: Hugging Face parameters not in any Galva module: model.hc_head.hc_fn"),
        # per-layer token inputs, computed before the layers (its tiny copy: a 128-row second table, not 262,144)
        ("gemma4_text", "gemma4_text: Hugging Face parameters not in any Galva module: model.embed_tokens_per_layer"),
    ],
)
def test_a_model_outside_what_galva_runs_is_one_line(family, message):
    """galva-train prints an :class:`UnsupportedModel` as its one error line (``galva-train: error: ...``)."""
    from galva_models.presets import tiny_config
    from galva_models.tables.errors import UnsupportedModel

    adapter = adapter_for(family)
    with pytest.raises(UnsupportedModel) as info:
        adapter.decompose(adapter.build_model(tiny_config(family)))
    assert message in str(info.value) and "\n" not in str(info.value)
