"""BERT for masked LM: embeddings (word + position + token type, LayerNorm), post-LN encoder layers, MLM head.

Galva modules:

- embedding ``BertEmbedding``: ``embeddings`` = the Hugging Face ``BertEmbeddings``
- layer ``"bert"`` ``BertEncoderLayer``: ``layer`` = ``BertLayer`` (bidirectional attention, no padding mask)
- head ``MLMHead``: ``cls`` = ``BertOnlyMLMHead`` (transform + decoder tied to the word embeddings)

BERT has no final norm; the head's transform (dense, activation, LayerNorm) plays that part.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

from galva_hp.model import LayeredModel, ParallelContext
from galva_models.adapters.base import (
    FamilyAdapter,
    LayerSpec,
    SingleRankParallelizer,
    Task,
    check_full_coverage,
    first_output,
    tie_pairs,
    token_loss_sum,
)
from galva_models.adapters.parallel import PostNormLayer, encoder_attention_form, layer_norm_form, mlp_form, renamer

_BERT_NAMES = renamer(
    {
        "attn.q_proj.": "layer.attention.self.query.",
        "attn.k_proj.": "layer.attention.self.key.",
        "attn.v_proj.": "layer.attention.self.value.",
        "attn.o_proj.": "layer.attention.output.dense.",
        "norm1.": "layer.attention.output.LayerNorm.",
        "mlp.up.": "layer.intermediate.dense.",
        "mlp.down.": "layer.output.dense.",
        "norm2.": "layer.output.LayerNorm.",
    }
)


class BertEmbedding(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.embeddings(input_ids=input_ids)


class BertEncoderLayer(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: Tensor) -> Tensor:
        return first_output(self.layer(hidden))


class MLMHead(nn.Module):
    def __init__(self, cls: nn.Module) -> None:
        super().__init__()
        self.cls = cls

    def forward(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        return token_loss_sum(self.cls(hidden), labels)


class BertParallelizer(SingleRankParallelizer):
    """Layers: Megatron tp (+SP) or Ulysses, bidirectional. Embedding and MLM head: degree 1 only (vocab tp/sp of
    BERT's embedding LayerNorm and tied MLM decoder is an open item)."""

    def __init__(self, config: Any) -> None:
        super().__init__("bert", config)

    def layer(self, module: Any, layer_type: str, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size == 1 and ctx.sp_size == 1:
            return module
        layer = module.layer
        sa, out = layer.attention.self, layer.attention.output
        weights = (sa.query.weight, sa.key.weight, sa.value.weight, out.dense.weight)
        biases = (sa.query.bias, sa.key.bias, sa.value.bias, out.dense.bias)
        attention = encoder_attention_form(weights, biases, self.config.num_attention_heads, ctx)
        mlp = mlp_form(layer.intermediate.dense, layer.output.dense, layer.intermediate.intermediate_act_fn, ctx)
        return PostNormLayer(
            attention, layer_norm_form(out.LayerNorm, ctx), mlp, layer_norm_form(layer.output.LayerNorm, ctx),
            copy.deepcopy(out.dropout), copy.deepcopy(layer.output.dropout), rename=_BERT_NAMES,
        )  # fmt: skip


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import BertForMaskedLM

    return BertForMaskedLM._from_config(config, attn_implementation=attn_implementation)


def decompose(model: Any) -> LayeredModel:
    """``BertForMaskedLM`` -> LayeredModel sharing its modules."""
    bert = model.bert
    layers: list[nn.Module] = [BertEncoderLayer(layer) for layer in bert.encoder.layer]
    layered = LayeredModel(
        embedding=BertEmbedding(bert.embeddings),
        layers=layers,
        head=MLMHead(model.cls),
        layer_types=["bert"] * len(layers),
        parallelizer=BertParallelizer(model.config),
        name="bert",
    )
    layered.tied_weights = tie_pairs(layered)
    check_full_coverage(model, layered)
    return layered


def layer_specs(config: Any, seq_length: int) -> list[LayerSpec]:
    if seq_length > config.max_position_embeddings:
        raise ValueError(f"seq_length {seq_length} exceeds max_position_embeddings {config.max_position_embeddings}")
    spec = LayerSpec("bert", config.num_attention_heads, config.num_attention_heads, seq_length, config.hidden_size)
    return [spec] * config.num_hidden_layers


def set_num_layers(config: Any, num_layers: int) -> None:
    config.num_hidden_layers = num_layers


ADAPTER = FamilyAdapter(
    name="bert",
    model_types=("bert",),
    task=Task.MASKED_LM,
    build_model=build_model,
    decompose=decompose,
    layer_specs=layer_specs,
    set_num_layers=set_num_layers,
    parallel_forms=frozenset({"tp", "megatron_sp", "ulysses"}),
)
