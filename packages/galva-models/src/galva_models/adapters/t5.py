"""T5 (encoder-decoder LM): the encoder and the decoder are two layer types.

How the decoder gets the encoder output: every module boundary carries ONE tensor ``[b, S_enc + S_dec, h]``, the
encoder stream followed by the decoder stream. The embedding embeds ``inputs = [encoder ids ; decoder input ids]``
(decoder input ids = labels shifted right, as Hugging Face does). An ``"t5_encoder"`` layer updates the first
``S_enc`` positions and passes the decoder part through; the last encoder layer also applies the encoder's final
LayerNorm. A ``"t5_decoder"`` layer updates the last ``S_dec`` positions, cross-attending to the first ``S_enc``
(the finished encoder output), which it passes through unchanged, so gradients reach the encoder through every
decoder layer. The head scores the decoder part only. This keeps the pipeline contract (one ``[b, s, h]`` tensor
between stages) at the price of sending the encoder output along the decoder stages.

Relative position bias: Hugging Face computes it in the first block of each stack and reuses it. Here every layer
computes it itself (:class:`RelativeBias`) from the stack's one ``relative_attention_bias`` table. The table is a
parameter of the stack's first layer only (inside its Hugging Face block); the other layers hold an *unregistered*
reference, so autograd sums every layer's contribution into that one parameter and the optimizer sees it once.
This is exact as long as each stack's layers sit on one pipeline stage, are not tensor parallel and the table is
not sharded by ZeRO-3; :func:`plan_problem` refuses other plans (a general fix needs galva-hp to tie parameters
between layers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from galva_hp.model import LayeredModel
from galva_models.adapters.base import (
    FamilyAdapter,
    LayerSpec,
    LMHead,
    SingleRankParallelizer,
    Task,
    check_full_coverage,
    tie_pairs,
)


class T5Embedding(nn.Module):
    def __init__(self, shared: nn.Embedding, dropout: nn.Module) -> None:
        super().__init__()
        self.shared = shared
        self.dropout = dropout

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.dropout(self.shared(input_ids))


class RelativeBias(nn.Module):
    """The stack's bucketed relative-position bias ``[1, heads, q, k]`` (same maths as ``T5Attention``)."""

    def __init__(self, attention: Any) -> None:
        super().__init__()
        self._table = (attention.relative_attention_bias,)  # a tuple: not registered (see the module docstring)
        self.bidirectional = not attention.is_decoder
        self.num_buckets = attention.relative_attention_num_buckets
        self.max_distance = attention.relative_attention_max_distance
        self._bucket = type(attention)._relative_position_bucket

    def forward(self, length: int, device: torch.device) -> Tensor:
        pos = torch.arange(length, dtype=torch.long, device=device)
        relative = pos[None, :] - pos[:, None]
        buckets = self._bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self._table[0](buckets).permute(2, 0, 1).unsqueeze(0)


class T5EncoderLayer(nn.Module):
    def __init__(
        self, block: nn.Module, bias: RelativeBias, encoder_length: int, final: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.block = block
        self.bias = bias
        self.encoder_length = encoder_length
        self.final = final  # encoder final LayerNorm + dropout on the last encoder layer

    def forward(self, hidden: Tensor) -> Tensor:
        enc, dec = hidden[:, : self.encoder_length], hidden[:, self.encoder_length :]
        enc = self.block(enc, None, self.bias(enc.shape[1], enc.device))[0]
        if self.final is not None:
            enc = self.final(enc)
        return torch.cat([enc, dec], dim=1)


class T5DecoderLayer(nn.Module):
    def __init__(self, block: nn.Module, bias: RelativeBias, encoder_length: int) -> None:
        super().__init__()
        self.block = block
        self.bias = bias
        self.encoder_length = encoder_length

    def forward(self, hidden: Tensor) -> Tensor:
        enc, dec = hidden[:, : self.encoder_length], hidden[:, self.encoder_length :]
        length = dec.shape[1]
        causal = torch.full((length, length), torch.finfo(dec.dtype).min, dtype=dec.dtype, device=dec.device)
        bias = self.bias(length, dec.device) + torch.triu(causal, diagonal=1)  # additive causal mask in the bias
        dec = self.block(dec, None, bias, enc, None, None)[0]
        return torch.cat([enc, dec], dim=1)


class T5Head(nn.Module):
    def __init__(self, encoder_length: int, lm: LMHead) -> None:
        super().__init__()
        self.encoder_length = encoder_length
        self.lm = lm

    def forward(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        return self.lm(hidden[:, self.encoder_length :], labels)


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration._from_config(config, attn_implementation=attn_implementation)


def decompose(model: Any, encoder_seq_length: int | None = None) -> LayeredModel:
    """``T5ForConditionalGeneration`` -> LayeredModel; ``encoder_seq_length`` fixes where the decoder part starts."""
    if encoder_seq_length is None:
        raise ValueError("t5: decompose needs encoder_seq_length (the split of [encoder ; decoder] positions)")
    enc, dec = model.encoder, model.decoder
    enc_bias = RelativeBias(enc.block[0].layer[0].SelfAttention)
    dec_bias = RelativeBias(dec.block[0].layer[0].SelfAttention)
    n_enc = len(enc.block)
    final = nn.Sequential(enc.final_layer_norm, enc.dropout)
    layers: list[nn.Module] = [
        T5EncoderLayer(block, enc_bias, encoder_seq_length, final if i == n_enc - 1 else None)
        for i, block in enumerate(enc.block)
    ]
    layers += [T5DecoderLayer(block, dec_bias, encoder_seq_length) for block in dec.block]
    scale = model.model_dim**-0.5 if getattr(model.config, "scale_decoder_outputs", False) else 1.0
    head = T5Head(encoder_seq_length, LMHead(nn.Sequential(dec.final_layer_norm, dec.dropout), model.lm_head, scale))
    layered = LayeredModel(
        embedding=T5Embedding(model.shared, enc.dropout),
        layers=layers,
        head=head,
        layer_types=["t5_encoder"] * n_enc + ["t5_decoder"] * len(dec.block),
        parallelizer=SingleRankParallelizer("t5", model.config),
        name="t5",
    )
    layered.tied_weights = tie_pairs(layered)
    check_full_coverage(model, layered)
    return layered


def layer_specs(config: Any, seq_length: int, decoder_seq_length: int | None = None) -> list[LayerSpec]:
    """Boundary sequence is ``S_enc + S_dec`` for both layer types (see the module docstring)."""
    total = seq_length + (decoder_seq_length or seq_length)
    n_dec = config.num_decoder_layers if config.num_decoder_layers is not None else config.num_layers
    enc = LayerSpec("t5_encoder", config.num_heads, config.num_heads, total, config.d_model)
    dec = LayerSpec("t5_decoder", config.num_heads, config.num_heads, total, config.d_model)
    return [enc] * config.num_layers + [dec] * n_dec


def plan_problem(strategy: Any, config: Any) -> str | None:
    """Plans under which the shared relative-position tables stay exact (see the module docstring)."""
    if any(layer.ulysses or layer.tp > 1 for layer in strategy.layers):
        return "t5: no tensor-parallel or Ulysses form yet; use tp 1"
    if any(strategy.layer_dp_type(i).value == "zero3" for i in range(strategy.num_layers)):
        return "t5: ZeRO-3 would shard the relative-position tables the layers share; use ddp or zero2"
    stages, n_enc = strategy.layer_stages, config.num_layers
    for stack, part in (("encoder", stages[:n_enc]), ("decoder", stages[n_enc:])):
        if len(set(part)) > 1:
            return (
                f"t5: the {stack} layers span pipeline stages {sorted(set(part))}; they share one relative-position "
                f"table, so keep each stack on one stage (e.g. --pp 2 splits encoder and decoder)"
            )
    return None


def set_num_layers(config: Any, num_layers: int) -> None:
    """``num_layers`` counts encoder plus decoder layers; they are split evenly."""
    if num_layers % 2:
        raise ValueError(f"t5: --num-layers {num_layers} must be even (encoder and decoder get half each)")
    config.num_layers = config.num_decoder_layers = num_layers // 2


ADAPTER = FamilyAdapter(
    name="t5",
    model_types=("t5",),
    task=Task.SEQ2SEQ_LM,
    build_model=build_model,
    decompose=decompose,
    layer_specs=layer_specs,
    set_num_layers=set_num_layers,
    plan_check=plan_problem,
    notes=("each stack's relative-position table is a parameter of its first layer, read by all of its layers",),
)
