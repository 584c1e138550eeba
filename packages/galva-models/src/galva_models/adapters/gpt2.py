"""GPT-2: token + learned position embedding, pre-LN blocks (Conv1D weights), final LayerNorm, tied LM head.

Galva modules (names relative to the module):

- embedding ``GPT2Embedding``: ``wte``, ``wpe`` (+ dropout) ``input_ids [b, s] -> [b, s, h]``
- layer ``"gpt2"`` ``GPT2Layer``: ``block`` = the Hugging Face ``GPT2Block``
- head ``LMHead``: ``norm`` = ``ln_f``, ``lm_head`` (weight tied to ``embedding.wte.weight``)
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

from galva_hp.model import LayeredModel, ParallelContext
from galva_models.adapters.base import FamilyAdapter, LayerSpec, Task, tie_and_check
from galva_models.adapters.modules import LMHead, first_output, positions
from galva_models.adapters.parallel import (
    LMHeadParallelizer,
    PreNormLayer,
    SequenceOffsetEmbedding,
    dropout_form,
    fuse_rows,
    layer_norm_form,
    linear_from,
    mlp_form,
    renamer,
)
from galva_models.adapters.parallel import (
    tp_group as _tp_group,
)
from galva_schema import ModelConstraints, ParallelForm
from galva_schema.constraints import uniform_constraints


class GPT2Embedding(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: Tensor, position_offset: int = 0) -> Tensor:
        pos = positions(input_ids.shape[1], input_ids.device, position_offset)
        return self.drop(self.wte(input_ids) + self.wpe(pos))


class GPT2Layer(nn.Module):
    """One ``GPT2Block``; causal self-attention through the run's attention backend (SDPA ``is_causal``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: Tensor) -> Tensor:
        return first_output(self.block(hidden))


_GPT2_PREFIXES = renamer(
    {
        "norm1.": "block.ln_1.",
        "norm2.": "block.ln_2.",
        "attn.o_proj.": "block.attn.c_proj.",
        "mlp.up.": "block.mlp.c_fc.",
        "mlp.down.": "block.mlp.c_proj.",
    },
    {name: lambda t: t.t().contiguous() for name in ("block.attn.c_proj.weight", "block.mlp.c_fc.weight",
                                                     "block.mlp.c_proj.weight")},
)  # fmt: skip


def _gpt2_names(parts: dict[str, Tensor]) -> dict[str, Tensor]:
    """Parallel GPT-2 layer state -> ``GPT2Block`` names and Conv1D (``[in, out]``) layouts, q/k/v fused."""
    qkv = [f"attn.{p}_proj.weight" for p in "qkv"]
    parts = fuse_rows(parts, qkv, "block.attn.c_attn.weight", transpose=True)
    parts = fuse_rows(parts, [f"attn.{p}_proj.bias" for p in "qkv"], "block.attn.c_attn.bias")
    return _GPT2_PREFIXES(parts)


class GPT2Parallelizer(LMHeadParallelizer):
    """Parallel forms of GPT-2: Megatron tp (+SP) or Ulysses layers; vocab-tp or vocab-sp embedding and head.

    Conv1D weights are ``[in, out]``; the parallel forms take the ``nn.Linear`` layout (transposed copies).
    """

    def layer(self, module: Any, layer_type: str, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size == 1 and ctx.sp_size == 1:
            return module
        block = module.block
        attn, mlp = block.attn, block.mlp
        hidden, heads = self.config.n_embd, self.config.n_head
        qkv_w = attn.c_attn.weight.t()
        q_w, k_w, v_w = qkv_w.split(hidden, dim=0)
        q_b, k_b, v_b = attn.c_attn.bias.split(hidden)
        o_w, o_b = attn.c_proj.weight.t(), attn.c_proj.bias
        attention: nn.Module
        if ctx.sp_size > 1:
            from galva_hp.parallel.ulysses import UlyssesAttention

            attention = UlyssesAttention(
                linear_from(q_w, q_b), linear_from(k_w, k_b), linear_from(v_w, v_b), linear_from(o_w, o_b),
                heads=heads, kv_heads=heads, head_dim=hidden // heads, group=ctx.sp_group,
                dropout=self.config.attn_pdrop,
            )  # fmt: skip
        else:
            from galva_hp.parallel.tensor_parallel import TensorParallelAttention

            attention = TensorParallelAttention(
                q_w, k_w, v_w, o_w, q_b, k_b, v_b, o_b,
                heads=heads, kv_heads=heads, group=_tp_group(ctx), sequence_parallel=ctx.megatron_sp,
                dropout=self.config.attn_pdrop,
            )  # fmt: skip
        up = linear_from(mlp.c_fc.weight.t(), mlp.c_fc.bias)
        down = linear_from(mlp.c_proj.weight.t(), mlp.c_proj.bias)
        feed_forward = mlp_form(up, down, mlp.act, ctx)
        return PreNormLayer(
            layer_norm_form(block.ln_1, ctx), attention, layer_norm_form(block.ln_2, ctx), feed_forward,
            dropout_form(attn.resid_dropout, ctx), dropout_form(mlp.dropout, ctx), rename=_gpt2_names,
        )  # fmt: skip

    def embedding(self, module: Any, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size > 1:
            from galva_hp.parallel.vocab import VocabParallelEmbedding

            tokens = VocabParallelEmbedding(module.wte.weight, ctx.tp_group, sequence_parallel=ctx.megatron_sp)
            sliced = ctx.megatron_sp
            group = ctx.tp_group if sliced else None
            drop = dropout_form(module.drop, ctx)
            return SequenceOffsetEmbedding(tokens, module.wpe, drop, group, sum_position_grad=sliced)
        if ctx.vocab_sp:  # ids arrive as this rank's sequence slice: shift the positions, draw this rank's mask
            drop = dropout_form(module.drop, ctx)
            return SequenceOffsetEmbedding(copy.deepcopy(module.wte), module.wpe, drop, ctx.sp_group)
        return module


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel._from_config(config, attn_implementation=attn_implementation)


def decompose(model: Any) -> LayeredModel:
    """``GPT2LMHeadModel`` -> LayeredModel sharing its modules."""
    t = model.transformer
    layered = LayeredModel(
        embedding=GPT2Embedding(t.wte, t.wpe, t.drop),
        layers=[GPT2Layer(block) for block in t.h],
        head=LMHead(t.ln_f, model.lm_head),
        layer_types=["gpt2"] * len(t.h),
        parallelizer=GPT2Parallelizer(model.config),
        name="gpt2",
        constraints=constraints(model.config),
    )
    return tie_and_check(model, layered)


def constraints(config: Any, seq_length: int | None = None, decoder_seq_length: int | None = None) -> ModelConstraints:
    """Every form runs (dropout included); the parallel attention lacks GPT-2's optional score scalings."""
    unsupported = {}
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
        reason = "parallel attention supports only the default 1/sqrt(head_dim) attention scaling"
        unsupported = {ParallelForm.TP: reason, ParallelForm.ULYSSES: reason}
    return uniform_constraints(
        "gpt2", "gpt2", config.n_layer, config.n_head, unsupported=unsupported, max_seq_length=config.n_positions
    )


def layer_specs(config: Any, seq_length: int) -> list[LayerSpec]:
    return [LayerSpec("gpt2", seq_length, config.n_embd)] * config.n_layer


def set_num_layers(config: Any, num_layers: int) -> None:
    config.n_layer = num_layers


ADAPTER = FamilyAdapter(
    name="gpt2", model_types=("gpt2",), task=Task.CAUSAL_LM,
    build_model=build_model, decompose=decompose, constraints=constraints, layer_specs=layer_specs,
    set_num_layers=set_num_layers, ffn_size_field="n_inner",
)  # fmt: skip
