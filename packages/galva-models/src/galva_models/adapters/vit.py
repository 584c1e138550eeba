"""ViT for image classification: patch + position embedding with a CLS token, pre-LN layers, LayerNorm + classifier.

Galva modules:

- embedding ``HFEmbeddings``: ``embeddings`` = ``ViTEmbeddings`` ``pixels [b, c, H, W] -> [b, 1 + patches, h]``
- layer ``"vit"`` ``HFLayer``: ``layer`` = ``ViTLayer``
- head ``ClassifierHead``: ``norm`` (final LayerNorm), ``classifier`` on the CLS token; loss summed over samples
"""

from __future__ import annotations

from typing import Any

from torch import nn

from galva_hp.model import LayeredModel, ParallelContext
from galva_models.adapters.base import (
    FamilyAdapter,
    LayerSpec,
    SingleRankParallelizer,
    Task,
    image_vocab_unsupported,
    set_num_hidden_layers,
    tie_and_check,
)
from galva_models.adapters.modules import ClassifierHead, HFEmbeddings, HFLayer
from galva_models.adapters.parallel import (
    ImageVocabForms,
    PreNormLayer,
    dropout_form,
    encoder_attention_form,
    layer_norm_form,
    mlp_form,
    renamer,
)
from galva_schema import LayerTypeConstraints, ModelConstraints

_VIT_NAMES = renamer(
    {
        "attn.": "layer.attention.",
        "norm1.": "layer.layernorm_before.",
        "norm2.": "layer.layernorm_after.",
        "mlp.up.": "layer.mlp.fc1.",
        "mlp.down.": "layer.mlp.fc2.",
    }
)


class ViTParallelizer(ImageVocabForms, SingleRankParallelizer):
    """Layers: Megatron tp (+SP) or Ulysses, bidirectional. Patch embedding and classifier: :class:`ImageVocabForms`
    (vocab tp: classifier split over the labels; sequence-split embedding under Megatron-SP)."""

    def __init__(self, config: Any) -> None:
        super().__init__("vit", config)

    def layer(self, module: Any, layer_type: str, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size == 1 and ctx.sp_size == 1:
            return module
        layer = module.layer
        a, mlp = layer.attention, layer.mlp
        weights = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight)
        biases = (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, a.o_proj.bias)
        p_attn = float(getattr(self.config, "attention_probs_dropout_prob", 0.0) or 0.0)
        attention = encoder_attention_form(weights, biases, self.config.num_attention_heads, ctx, dropout=p_attn)
        feed_forward = mlp_form(mlp.fc1, mlp.fc2, mlp.activation_fn, ctx)
        return PreNormLayer(
            layer_norm_form(layer.layernorm_before, ctx), attention, layer_norm_form(layer.layernorm_after, ctx),
            feed_forward, dropout_form(layer.dropout, ctx), dropout_form(layer.dropout, ctx), rename=_VIT_NAMES,
        )  # fmt: skip


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import ViTForImageClassification

    return ViTForImageClassification._from_config(config, attn_implementation=attn_implementation)


def decompose(model: Any) -> LayeredModel:
    """``ViTForImageClassification`` -> LayeredModel sharing its modules."""
    vit = model.vit
    blocks = vit.layers if hasattr(vit, "layers") else vit.encoder.layer  # transformers 5 flattened it
    layers: list[nn.Module] = [HFLayer(layer) for layer in blocks]
    layered = LayeredModel(
        embedding=HFEmbeddings(vit.embeddings),
        layers=layers,
        head=ClassifierHead(vit.layernorm, model.classifier),
        layer_types=["vit"] * len(layers),
        parallelizer=ViTParallelizer(model.config),
        name="vit",
        constraints=constraints(model.config),
    )
    return tie_and_check(model, layered)


def _tokens(config: Any) -> int:
    """A ViT's sequence: the CLS token and one token per patch."""
    return 1 + (config.image_size // config.patch_size) ** 2


def constraints(config: Any, seq_length: int | None = None, decoder_seq_length: int | None = None) -> ModelConstraints:
    """Every layer form runs on the image's tokens; the patch embedding and classifier run vocab tp, not vocab sp."""
    layers = LayerTypeConstraints(
        name="vit",
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        seq_length=_tokens(config),
    )
    return ModelConstraints(model_name="vit", layer_types=(layers,), vocab_unsupported=image_vocab_unsupported("vit"))


def layer_specs(config: Any, seq_length: int) -> list[LayerSpec]:
    """``seq_length`` is ignored: the image fixes the sequence."""
    return [LayerSpec("vit", _tokens(config), config.hidden_size)] * config.num_hidden_layers


ADAPTER = FamilyAdapter(
    name="vit", model_types=("vit",), task=Task.IMAGE_CLASSIFICATION,
    build_model=build_model, decompose=decompose, constraints=constraints, layer_specs=layer_specs,
    set_num_layers=set_num_hidden_layers, ffn_size_field="intermediate_size",
)  # fmt: skip
