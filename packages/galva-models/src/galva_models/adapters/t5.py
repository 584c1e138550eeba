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
reference, so autograd sums every layer's contribution into that one parameter and the optimizer (and the
data-parallel reduction of the first layer's unit) sees it once. This is exact as long as each stack's layers sit
on one pipeline stage with one tp layout and the table is not sharded by ZeRO-3. :func:`constraints` declares this,
so galva-schema's ``plan_problems`` refuses other plans (a general fix needs galva-hp to tie parameters between
layers).

Tensor parallelism (:class:`T5Parallelizer`): Megatron column-parallel q / k / v over heads and row-parallel o in
self- and cross-attention (:class:`T5TPAttention`, T5's unscaled scores plus the additive position bias), the FFN
(``DenseReluDense`` or gated-gelu) column/row-parallel, T5's RMS-style norms replicated. The relative-position
table is split by heads: the stack's first layer holds this rank's columns ``[buckets, heads/tp]`` as a new
parameter (tagged as a tp shard), and the stack's other layers on this rank read that same shard through an
unregistered reference, exactly as in the single-process form. Layers are converted in order, so the first layer's
form makes the shard and the later ones find it (:meth:`T5Parallelizer.layer`). Megatron-SP and Ulysses are not
supported: a sequence slice of ``[encoder ; decoder]`` would not respect the two streams.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.model import LayeredModel, ParallelContext
from galva_models.adapters.base import FamilyAdapter, LayerSpec, SingleRankParallelizer, Task, tie_and_check
from galva_models.adapters.modules import LMHead
from galva_models.adapters.parallel import tp_group
from galva_schema import LayerTypeConstraints, ModelConstraints, ParallelForm, SharedParameter


class T5Embedding(nn.Module):
    def __init__(self, shared: nn.Embedding, dropout: nn.Module) -> None:
        super().__init__()
        self.shared = shared
        self.dropout = dropout

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.dropout(self.shared(input_ids))


class RelativeBias(nn.Module):
    """A stack's bucketed relative-position bias ``[1, heads, q, k]`` (same maths as ``T5Attention``), read from a
    table it does not register (see the module docstring)."""

    def __init__(
        self,
        table: nn.Embedding,
        bidirectional: bool,
        num_buckets: int,
        max_distance: int,
        bucket: Callable[..., Tensor],
    ) -> None:
        super().__init__()
        self._table = (table,)  # a tuple: not registered
        self.bidirectional, self.num_buckets, self.max_distance = bidirectional, num_buckets, max_distance
        self._bucket = bucket

    @classmethod
    def of(cls, attention: Any) -> RelativeBias:
        """The bias of a Hugging Face ``T5Attention`` that has the stack's table."""
        return cls(
            attention.relative_attention_bias,
            not attention.is_decoder,
            attention.relative_attention_num_buckets,
            attention.relative_attention_max_distance,
            type(attention)._relative_position_bucket,
        )

    @property
    def table(self) -> nn.Embedding:
        return self._table[0]

    def sharded(self, group: ProcessGroup) -> RelativeBias:
        """The same bias for this rank's heads only, from a *new* table holding their columns (a tp shard)."""
        from galva_hp.parallel.mappings import group_rank, group_size
        from galva_hp.parallel.tensor_parallel import mark_tp_split, shard

        columns = shard(self.table.weight.detach(), 1, group_rank(group), group_size(group)).clone()
        table = nn.Embedding.from_pretrained(columns, freeze=False)
        mark_tp_split(table.weight, 1, group)
        return RelativeBias(table, self.bidirectional, self.num_buckets, self.max_distance, self._bucket)

    def forward(self, length: int, device: torch.device) -> Tensor:
        pos = torch.arange(length, dtype=torch.long, device=device)
        relative = pos[None, :] - pos[:, None]
        buckets = self._bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self.table(buckets).permute(2, 0, 1).unsqueeze(0)


def _causal(bias: Tensor) -> Tensor:
    """``bias`` plus an additive causal mask over its last two dims."""
    length = bias.shape[-1]
    mask = torch.full((length, length), torch.finfo(bias.dtype).min, dtype=bias.dtype, device=bias.device)
    return bias + torch.triu(mask, diagonal=1)


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
        bias = _causal(self.bias(dec.shape[1], dec.device))  # additive causal mask in the bias
        dec = self.block(dec, None, bias, enc, None, None)[0]
        return torch.cat([enc, dec], dim=1)


class T5Head(nn.Module):
    def __init__(self, encoder_length: int, lm: LMHead) -> None:
        super().__init__()
        self.encoder_length = encoder_length
        self.lm = lm

    def forward(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        return self.lm(hidden[:, self.encoder_length :], labels)


# ------------------------------------------------------------------------------------------ tensor-parallel form
class T5TPAttention(nn.Module):
    """T5 attention over this rank's heads: column-parallel ``q`` and fused ``kv`` (local rows ``[k_r; v_r]``),
    row-parallel ``o``; scores ``q k^T`` (T5 does not scale them) plus an additive bias of the local heads.

    Self-attention reads keys and values from its input, cross-attention from ``memory`` (the encoder output).
    ``table`` (the stack's first self-attention only) registers this rank's relative-position shard here, under
    Hugging Face's name ``relative_attention_bias``.
    """

    def __init__(self, attention: Any, group: ProcessGroup, table: nn.Embedding | None = None) -> None:
        super().__init__()
        from galva_hp.parallel.mappings import group_rank, group_size
        from galva_hp.parallel.tensor_parallel import column_parallel_linear, row_parallel_linear, shard

        tp, rank = group_size(group), group_rank(group)
        heads = attention.n_heads
        if heads % tp:
            raise ValueError(f"t5: tp={tp} does not divide the {heads} attention heads")
        self.group, self.local_heads, self.head_dim = group, heads // tp, attention.key_value_proj_dim
        self.dropout = float(attention.dropout)
        hidden = attention.q.weight.shape[1]
        q, k, v = (shard(p.weight.detach(), 0, rank, tp) for p in (attention.q, attention.k, attention.v))
        self.q = column_parallel_linear(q, None, hidden, group)
        self.kv = column_parallel_linear(torch.cat([k, v]), None, hidden, group)
        self.o = row_parallel_linear(shard(attention.o.weight.detach(), 1, rank, tp), None, group)
        self.relative_attention_bias = table

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        """Hugging Face's ``q / k / v / o`` (and ``relative_attention_bias``) tensors, assembled over the tp group."""
        from galva_hp.parallel.mappings import all_gather_along_dim
        from galva_hp.parallel.tensor_parallel import param_or_grad

        full = {"q.weight": all_gather_along_dim(param_or_grad(self.q.weight, grads), 0, self.group)}
        for name, part in zip(("k", "v"), param_or_grad(self.kv.weight, grads).chunk(2)):
            full[f"{name}.weight"] = all_gather_along_dim(part, 0, self.group)
        full["o.weight"] = all_gather_along_dim(param_or_grad(self.o.weight, grads), 1, self.group)
        if self.relative_attention_bias is not None:
            table = param_or_grad(self.relative_attention_bias.weight, grads)
            full["relative_attention_bias.weight"] = all_gather_along_dim(table, 1, self.group)
        return full

    def forward(self, x: Tensor, bias: Tensor | None, memory: Tensor | None = None) -> Tensor:
        from galva_hp.parallel.tensor_parallel import enter_tp_region, exit_tp_region

        x = enter_tp_region(x, self.group, False)
        source = x if memory is None else enter_tp_region(memory, self.group, False)
        (b, s), s_kv = x.shape[:2], source.shape[1]
        q = self.q(x)[0].view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k, v = (
            t.view(b, s_kv, self.local_heads, self.head_dim).transpose(1, 2) for t in self.kv(source)[0].chunk(2, -1)
        )
        from galva_hp.parallel.rng import rank_stream

        dropout = self.dropout if self.training else 0.0
        with rank_stream(self.group, x.device) if dropout else contextlib.nullcontext():  # this rank's heads
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=1.0)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return exit_tp_region(F.linear(out, self.o.weight), self.group, False)


class _Activation(nn.Module):
    """T5's FFN middle: ``dropout(act(h))``, or ``dropout(act(gate) * up)`` for the gated form. ``dropout`` is used
    as given: under tp the middle is split over the ranks, so it is a ``ShardedDropout`` (a mask per rank)."""

    def __init__(self, act: nn.Module, dropout: nn.Module) -> None:
        super().__init__()
        self.act, self.dropout = copy.deepcopy(act), dropout

    def forward(self, h: Tensor, up: Tensor | None = None) -> Tensor:
        h = self.act(h)
        return self.dropout(h if up is None else h * up)


def _ffn_form(ff: Any, group: ProcessGroup) -> nn.Module:
    """``DenseReluDense`` (``wi`` / ``wo``) or the gated form (``wi_0``, ``wi_1`` / ``wo``), column/row parallel."""
    from galva_hp.parallel.rng import ShardedDropout
    from galva_hp.parallel.tensor_parallel import TensorParallelMLP

    names = ["wi_0", "wi_1"] if hasattr(ff, "wi_0") else ["wi"]
    ups = [getattr(ff, n).weight.detach() for n in names]
    p = float(getattr(ff.dropout, "p", 0.0))
    dropout = ShardedDropout(p, group) if p else copy.deepcopy(ff.dropout)
    return TensorParallelMLP(
        ups, [None] * len(ups), ff.wo.weight.detach(), None, _Activation(ff.act, dropout),
        group=group, names=(names, "wo"),
    )  # fmt: skip


class _SubLayer(nn.Module):
    """One T5 sub-layer ``x + dropout(inner(layer_norm(x), ...))``; ``inner`` is registered under Hugging Face's
    name (``SelfAttention``, ``EncDecAttention``, ``DenseReluDense``), so the gathered state has its names."""

    def __init__(self, sub: Any, inner_name: str, inner: nn.Module) -> None:
        super().__init__()
        self.layer_norm = copy.deepcopy(sub.layer_norm)  # replicated over tp (it sees the full hidden)
        self.add_module(inner_name, inner)
        self.dropout = copy.deepcopy(sub.dropout)
        self._inner = inner_name

    def forward(self, x: Tensor, *args: Tensor | None) -> Tensor:
        return x + self.dropout(getattr(self, self._inner)(self.layer_norm(x), *args))


class _Block(nn.Module):
    """Holds the sub-layers as ``layer.<i>`` like ``T5Block``."""

    def __init__(self, subs: list[nn.Module]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(subs)


class T5TPEncoderLayer(nn.Module):
    """Tensor-parallel ``"t5_encoder"`` layer; gathers to :class:`T5EncoderLayer`'s names (``block.layer.0...``)."""

    def __init__(self, layer: T5EncoderLayer, bias: RelativeBias, group: ProcessGroup, owns_table: bool) -> None:
        super().__init__()
        hf: Any = layer.block.layer  # the Hugging Face sub-layers
        attention = T5TPAttention(hf[0].SelfAttention, group, bias.table if owns_table else None)
        ffn = _ffn_form(hf[1].DenseReluDense, group)
        self.block = _Block([_SubLayer(hf[0], "SelfAttention", attention), _SubLayer(hf[1], "DenseReluDense", ffn)])
        self.bias = bias
        self.encoder_length = layer.encoder_length
        self.final = copy.deepcopy(layer.final)

    def forward(self, hidden: Tensor) -> Tensor:
        enc, dec = hidden[:, : self.encoder_length], hidden[:, self.encoder_length :]
        enc = self.block.layer[0](enc, self.bias(enc.shape[1], enc.device))
        enc = self.block.layer[1](enc)
        if self.final is not None:
            enc = self.final(enc)
        return torch.cat([enc, dec], dim=1)


class T5TPDecoderLayer(nn.Module):
    """Tensor-parallel ``"t5_decoder"`` layer: self-attention, cross-attention to the encoder part, FFN."""

    def __init__(self, layer: T5DecoderLayer, bias: RelativeBias, group: ProcessGroup, owns_table: bool) -> None:
        super().__init__()
        hf: Any = layer.block.layer
        self_attention = T5TPAttention(hf[0].SelfAttention, group, bias.table if owns_table else None)
        self.block = _Block(
            [
                _SubLayer(hf[0], "SelfAttention", self_attention),
                _SubLayer(hf[1], "EncDecAttention", T5TPAttention(hf[1].EncDecAttention, group)),
                _SubLayer(hf[2], "DenseReluDense", _ffn_form(hf[2].DenseReluDense, group)),
            ]
        )
        self.bias = bias
        self.encoder_length = layer.encoder_length

    def forward(self, hidden: Tensor) -> Tensor:
        enc, dec = hidden[:, : self.encoder_length], hidden[:, self.encoder_length :]
        dec = self.block.layer[0](dec, _causal(self.bias(dec.shape[1], dec.device)))
        dec = self.block.layer[1](dec, None, enc)  # no position bias in cross-attention
        dec = self.block.layer[2](dec)
        return torch.cat([enc, dec], dim=1)


class T5Parallelizer(SingleRankParallelizer):
    """Layers: Megatron tp (see the module docstring). Embedding and head: degree 1.

    Converting a stack's first layer makes this rank's relative-position shard; the stack's later layers (converted
    after it, in layer order, by galva-hp's build) read the same shard. ``_shards`` maps the single-process
    :class:`RelativeBias` of a stack to ``(tp group, sharded bias)`` of the latest conversion.
    """

    def __init__(self, config: Any) -> None:
        super().__init__("t5", config)
        self._shards: weakref.WeakKeyDictionary[RelativeBias, tuple[ProcessGroup, RelativeBias]] = (
            weakref.WeakKeyDictionary()
        )

    def layer(self, module: Any, layer_type: str, ctx: ParallelContext) -> nn.Module:
        if ctx.sp_size > 1 or ctx.megatron_sp:
            self._check(f"{layer_type} layer", ctx)  # only tp has a form (Megatron-SP / Ulysses refused)
        if ctx.tp_size == 1:
            return module
        group = tp_group(ctx)
        stack = "encoder" if layer_type == "t5_encoder" else "decoder"
        owns_table = bool(module.block.layer[0].SelfAttention.has_relative_attention_bias)
        key = module.bias
        if owns_table:
            self._shards[key] = (group, module.bias.sharded(group))
        elif key not in self._shards or self._shards[key][0] is not group:
            raise ValueError(
                f"t5: a {stack} layer was converted before the {stack} stack's first layer with the same tp group "
                f"(that layer holds the shared relative-position table); keep a stack on one stage with one tp layout"
            )
        bias = self._shards[key][1]
        if layer_type == "t5_encoder":
            return T5TPEncoderLayer(module, bias, group, owns_table)
        return T5TPDecoderLayer(module, bias, group, owns_table)


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration._from_config(config, attn_implementation=attn_implementation)


def decompose(model: Any, encoder_seq_length: int | None = None, decoder_seq_length: int | None = None) -> LayeredModel:
    """``T5ForConditionalGeneration`` -> LayeredModel; ``encoder_seq_length`` fixes where the decoder part starts
    (``decoder_seq_length``, default the same, only completes the boundary length in the constraints)."""
    if encoder_seq_length is None:
        raise ValueError("t5: decompose needs encoder_seq_length (the split of [encoder ; decoder] positions)")
    enc, dec = model.encoder, model.decoder
    enc_bias = RelativeBias.of(enc.block[0].layer[0].SelfAttention)
    dec_bias = RelativeBias.of(dec.block[0].layer[0].SelfAttention)
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
        parallelizer=T5Parallelizer(model.config),
        name="t5",
        constraints=constraints(model.config, encoder_seq_length, decoder_seq_length),
    )
    return tie_and_check(model, layered)


def _num_decoder_layers(config: Any) -> int:
    return config.num_decoder_layers if config.num_decoder_layers is not None else config.num_layers


_NO_SEQUENCE_SPLIT = "a sequence slice of [encoder ; decoder] would cut across the two streams"
_NO_VOCAB_SPLIT = "t5 has no vocabulary-parallel embedding and head (the decoder part alone is scored)"


def constraints(config: Any, seq_length: int | None = None, decoder_seq_length: int | None = None) -> ModelConstraints:
    """tp only (heads split, the relative-position table too); each stack's layers share that table, so they stay
    on one stage with one tp layout and without ZeRO-3. The boundary sequence is ``S_enc + S_dec`` when known."""
    total = seq_length + (decoder_seq_length or seq_length) if seq_length else None
    unsupported = {
        ParallelForm.MEGATRON_SP: _NO_SEQUENCE_SPLIT,
        ParallelForm.ULYSSES: _NO_SEQUENCE_SPLIT,
        ParallelForm.ZERO3: "it would shard the relative-position table the stack's layers share; use ddp or zero2",
    }
    n_enc, n_dec = config.num_layers, _num_decoder_layers(config)
    stacks = (("t5_encoder", n_enc), ("t5_decoder", n_dec))
    return ModelConstraints(
        model_name="t5",
        layer_types=tuple(
            LayerTypeConstraints(
                name=name, num_layers=n, num_heads=config.num_heads, seq_length=total, unsupported=unsupported
            )
            for name, n in stacks
        ),
        vocab_unsupported={ParallelForm.VOCAB_TP: _NO_VOCAB_SPLIT, ParallelForm.VOCAB_SP: _NO_VOCAB_SPLIT},
        shared_parameters=(
            SharedParameter(name="encoder relative-position table", layers=(0, n_enc - 1)),
            SharedParameter(name="decoder relative-position table", layers=(n_enc, n_enc + n_dec - 1)),
        ),
    )


def layer_specs(config: Any, seq_length: int, decoder_seq_length: int | None = None) -> list[LayerSpec]:
    """Boundary sequence is ``S_enc + S_dec`` for both layer types (see the module docstring)."""
    total = seq_length + (decoder_seq_length or seq_length)
    enc = LayerSpec("t5_encoder", total, config.d_model)
    dec = LayerSpec("t5_decoder", total, config.d_model)
    return [enc] * config.num_layers + [dec] * _num_decoder_layers(config)


def set_num_layers(config: Any, num_layers: int) -> None:
    """``num_layers`` counts encoder plus decoder layers; they are split evenly."""
    if num_layers % 2:
        raise ValueError(f"t5: --num-layers {num_layers} must be even (encoder and decoder get half each)")
    config.num_layers = config.num_decoder_layers = num_layers // 2


ADAPTER = FamilyAdapter(
    name="t5", model_types=("t5",), task=Task.SEQ2SEQ_LM,
    build_model=build_model, decompose=decompose, constraints=constraints, layer_specs=layer_specs,
    set_num_layers=set_num_layers, ffn_size_field="d_ff", head_dim_from_hidden=False,  # d_kv sets the head size
)  # fmt: skip
