"""Llama and the families that share its shape: Mistral, Qwen2 (qkv bias). GQA, RoPE, RMSNorm, SwiGLU.

Galva modules:

- embedding ``TokenEmbedding``: ``embed_tokens``
- layer ``"llama"`` ``RotaryDecoderLayer``: ``layer`` = the Hugging Face decoder layer, plus a buffer-only
  rotary-embedding module of its own (each layer computes its cos/sin, so layers can sit on any pipeline stage)
  and its sliding window (Mistral's ``sliding_window``; Qwen2's on its ``"sliding_attention"`` layers), applied as a
  banded causal mask in every form (galva-hp's ``attention(window=...)``)
- head ``LMHead``: ``norm``, ``lm_head`` (tied to ``embedding.embed_tokens.weight`` when the config ties them)
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch
from torch import Tensor, nn

from galva_hp.model import LayeredModel, ParallelContext
from galva_models.adapters.base import FamilyAdapter, LayerSpec, Task, tie_and_check
from galva_models.adapters.modules import LMHead, first_output, positions
from galva_models.adapters.parallel import HFRotary, LMHeadParallelizer, PreNormLayer, layer_norm_form, renamer
from galva_models.adapters.parallel import tp_group as _tp_group
from galva_schema import ModelConstraints
from galva_schema.constraints import uniform_constraints


class TokenEmbedding(nn.Module):
    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)


class RotaryDecoderLayer(nn.Module):
    """A Llama-style decoder layer with its own rotary embedding; causal attention via SDPA ``is_causal``, or a banded
    causal mask when the layer has a sliding ``window`` shorter than the sequence (flash-attn takes the window from
    the Hugging Face module itself)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, window: int | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.window = window
        attn: Any = layer.self_attn
        self._hf_window = "flash" in str(attn.config._attn_implementation)  # flash-attn applies the window itself

    def forward(self, hidden: Tensor, position_offset: int = 0) -> Tensor:
        pos = positions(hidden.shape[1], hidden.device, position_offset)
        cos_sin = self.rotary(hidden, pos)
        mask = self._mask(hidden)
        return first_output(self.layer(hidden, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin))

    def _mask(self, hidden: Tensor) -> Tensor | None:
        seq = hidden.shape[1]
        if self.window is None or self.window >= seq or self._hf_window:
            return None
        from galva_hp.parallel.attention import sliding_window_mask

        allowed = sliding_window_mask(seq, self.window, hidden.device)
        blocked = torch.zeros(seq, seq, dtype=hidden.dtype, device=hidden.device)
        # additive form: eager attention adds the mask, SDPA accepts it as well
        return blocked.masked_fill(~allowed, torch.finfo(hidden.dtype).min)[None, None]


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention), as Hugging Face applies it."""
    window = getattr(config, "sliding_window", None)  # Qwen2 sets it to None without use_sliding_window
    n = config.num_hidden_layers
    if window is None:
        return [None] * n
    types = getattr(config, "layer_types", None)
    if types is None:  # Mistral: every layer
        return [window] * n
    return [window if t == "sliding_attention" else None for t in types]


class SwiGLU(nn.Module):
    """``act(gate) * up`` for galva-hp's fused column-parallel MLP."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.act(gate) * up


_LLAMA_NAMES = renamer(
    {
        "norm1.": "layer.input_layernorm.",
        "attn.": "layer.self_attn.",
        "norm2.": "layer.post_attention_layernorm.",
        "mlp.": "layer.mlp.",
    }
)


class LlamaParallelizer(LMHeadParallelizer):
    """Parallel forms of the Llama family: Megatron tp (+SP) or Ulysses layers, vocab-tp or vocab-sp embedding/head."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
        self._apply_rotary = modeling.apply_rotary_pos_emb

    def layer(self, module: Any, layer_type: str, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size == 1 and ctx.sp_size == 1:
            return module
        hf = module.layer
        attn, mlp = hf.self_attn, hf.mlp
        heads = self.config.num_attention_heads
        kv = getattr(self.config, "num_key_value_heads", None) or heads
        rotary = HFRotary(module.rotary, self._apply_rotary)
        window = module.window
        dropout = float(getattr(self.config, "attention_dropout", 0.0) or 0.0)
        attention: nn.Module
        if ctx.sp_size > 1:
            from galva_hp.parallel.ulysses import UlyssesAttention

            parts = [copy.deepcopy(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            attention = UlyssesAttention(
                *parts, heads=heads, kv_heads=kv, head_dim=attn.head_dim, group=ctx.sp_group, rotary=rotary,
                window=window, dropout=dropout,
            )  # fmt: skip
            feed_forward = copy.deepcopy(mlp)
        else:
            from galva_hp.parallel.tensor_parallel import TensorParallelAttention, TensorParallelMLP

            q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
            attention = TensorParallelAttention(
                q.weight, k.weight, v.weight, o.weight, q.bias, k.bias, v.bias, o.bias,
                heads=heads, kv_heads=kv, group=_tp_group(ctx), sequence_parallel=ctx.megatron_sp, rotary=rotary,
                window=window, dropout=dropout,
            )  # fmt: skip
            feed_forward = TensorParallelMLP(
                [mlp.gate_proj.weight, mlp.up_proj.weight],
                [mlp.gate_proj.bias, mlp.up_proj.bias],
                mlp.down_proj.weight,
                mlp.down_proj.bias,
                SwiGLU(copy.deepcopy(mlp.act_fn)),
                group=_tp_group(ctx),
                sequence_parallel=ctx.megatron_sp,
                names=(["gate_proj", "up_proj"], "down_proj"),
            )
        return PreNormLayer(
            layer_norm_form(hf.input_layernorm, ctx), attention, layer_norm_form(hf.post_attention_layernorm, ctx),
            feed_forward, rename=_LLAMA_NAMES,
        )  # fmt: skip

    def embedding(self, module: Any, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size > 1:
            from galva_hp.parallel.vocab import VocabParallelEmbedding

            weight = module.embed_tokens.weight
            return TokenEmbedding(VocabParallelEmbedding(weight, ctx.tp_group, sequence_parallel=ctx.megatron_sp))
        return copy.deepcopy(module) if ctx.vocab_sp else module  # token embedding needs no positions


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def decompose(model: Any) -> LayeredModel:
    """``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` -> LayeredModel sharing its modules."""
    inner = model.model
    rotary_cls = type(inner.rotary_emb)
    device = next(inner.rotary_emb.buffers()).device
    layers: list[nn.Module] = [
        RotaryDecoderLayer(layer, rotary_cls(config=model.config).to(device), window)
        for layer, window in zip(inner.layers, layer_windows(model.config))
    ]
    family = model.config.model_type
    layered = LayeredModel(
        embedding=TokenEmbedding(inner.embed_tokens),
        layers=layers,
        head=LMHead(inner.norm, model.lm_head),
        layer_types=[family] * len(layers),
        parallelizer=LlamaParallelizer(model.config),
        name=family,
        constraints=constraints(model.config),
    )
    return tie_and_check(model, layered)


def constraints(config: Any, seq_length: int | None = None, decoder_seq_length: int | None = None) -> ModelConstraints:
    """GQA heads; every form runs (attention dropout included)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    family = config.model_type
    return uniform_constraints(
        family,
        family,
        config.num_hidden_layers,
        heads,
        kv,
    )


def layer_specs(config: Any, seq_length: int) -> list[LayerSpec]:
    return [LayerSpec(config.model_type, seq_length, config.hidden_size)] * config.num_hidden_layers


def set_num_layers(config: Any, num_layers: int) -> None:
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[0]] * num_layers


ADAPTER = FamilyAdapter(
    name="llama", model_types=("llama", "mistral", "qwen2"), task=Task.CAUSAL_LM,
    build_model=build_model, decompose=decompose, constraints=constraints, layer_specs=layer_specs,
    set_num_layers=set_num_layers, ffn_size_field="intermediate_size", kv_heads_field="num_key_value_heads",
)  # fmt: skip
