"""T5's table entry and its hook: T5 (encoder-decoder LM) run as Hugging Face's own modules.

transformers gives T5 no tables, so Galva's entry says them in transformers' format: every ``T5Block`` of the
encoder's and then the decoder's stack is a Galva layer (``t5_encoder``, ``t5_decoder``), held in place under its
Hugging Face names; under tp its self-attention, cross-attention and feed-forward linears split by heads and
features in place (:data:`TABLE`), and ``T5Attention`` calls transformers' attention interface with its position
bias, so Galva's registered forms (heads over tp, Ulysses' all-to-all) run around the family's own code.

What a table cannot say is the hook :func:`cut`, which cuts the model instead of the table path's recorded forward:

- **two streams, one boundary**: every module boundary carries ONE tensor ``[b, S_enc + S_dec, h]``, the encoder
  stream followed by the decoder stream. The embedding embeds ``[encoder ids ; decoder input ids]`` (decoder input
  ids = labels shifted right, as Hugging Face does) with one dropout; an encoder layer updates the first ``S_enc``
  positions (the last one also applies the encoder's final norm and dropout), a decoder layer the rest, its
  cross-attention reading the first ``S_enc`` (the finished encoder output, passed through unchanged), so the
  encoder output reaches decoder layers on any stage and gradients reach the encoder through every decoder layer.
  The head scores the decoder part.
- **the relative-position bias**: Hugging Face computes it in each stack's first block and hands it on. Here every
  layer computes it (:class:`RelativeBias`, Hugging Face's bucketing) from its stack's one table, a galva-hp
  :class:`~galva_hp.shared_params.SharedWeight` at home in the stack's first block (where names, initialisation and
  checkpoints see it), read through by every layer of the stack, on whatever stage and layout; each rank reads the
  columns of the heads it computes (its tp or Ulysses share).
- **sequence forms** (Megatron-SP, Ulysses): a rank's contiguous block of ``[encoder ; decoder]`` may hold rows of
  both streams. The layer then runs its block on the whole block, with a bias over the whole stream that confines
  its stream's rows to their own stream (and the decoder's cross-attention to the encoder's rows), and keeps the
  output on its stream's rows only (the other rows, computed alongside, are dropped): Hugging Face's block runs
  unchanged on a slice, at the price of computing both streams in those forms.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from galva_hp.model import LayeredModel, ParallelContext
from galva_hp.parallel.mappings import group_rank, group_size
from galva_hp.shared_params import SharedWeight
from galva_models.tables.family import LayerSpec
from galva_models.tables.modules import ModuleForm, Shared, TableLayer, first_output, token_loss_sum
from galva_schema import LayerTypeConstraints, ModelConstraints, ParallelForm, SharedParameter

__all__ = ["TABLE", "constraints", "cut", "layer_specs"]

ENCODER, DECODER = "t5_encoder", "t5_decoder"


class RelativeBias:
    """A stack's bucketed relative-position bias ``[1, heads, s, s]`` (Hugging Face's ``T5Attention`` bucketing), read
    from the stack's shared table."""

    def __init__(self, table: SharedWeight, attention: Any) -> None:
        self.table = table
        self.bidirectional = not attention.is_decoder
        self.num_buckets = attention.relative_attention_num_buckets
        self.max_distance = attention.relative_attention_max_distance
        self.bucket = type(attention)._relative_position_bucket

    def __call__(self, length: int, device: torch.device, heads: slice) -> Tensor:
        pos = torch.arange(length, dtype=torch.long, device=device)
        buckets = self.bucket(pos[None, :] - pos[:, None], self.bidirectional, self.num_buckets, self.max_distance)
        return F.embedding(buckets, self.table.value()[:, heads]).permute(2, 0, 1).unsqueeze(0)


def _lowest(like: Tensor) -> float:
    return float(torch.finfo(like.dtype).min)


def _causal(bias: Tensor) -> Tensor:
    """``bias`` with an additive causal mask over its last two dims."""
    length = bias.shape[-1]
    upper = torch.ones(length, length, dtype=torch.bool, device=bias.device).triu(1)
    return bias.masked_fill(upper, _lowest(bias))


def _within(bias: Tensor, own: slice, total: int) -> Tensor:
    """``bias`` of one stream placed in a bias over the whole ``total``-token stream: its rows see its own stream only,
    the other stream's rows see themselves only (their outputs are dropped; a row seeing nothing would be NaN)."""
    whole = torch.full((1, bias.shape[1], total, total), _lowest(bias), dtype=bias.dtype, device=bias.device)
    whole.diagonal(dim1=-2, dim2=-1).fill_(0.0)
    whole[..., own, own] = bias
    return whole


class T5Embedding(nn.Module):
    """The shared token table over ``[encoder ids ; decoder input ids]``, then the encoder's dropout."""

    def __init__(self, shared: nn.Module, dropout: nn.Module) -> None:
        super().__init__()
        self.shared, self.dropout = shared, dropout

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.dropout(self.shared(input_ids))


class T5Layer(TableLayer):
    """One ``T5Block`` (Hugging Face's, in place, as ``layer``) on the ``[encoder ; decoder]`` stream; the last encoder
    layer also holds the encoder's final norm and dropout (``final``). Its tp form is the table path's."""

    def __init__(
        self, block: nn.Module, index: int, bias: RelativeBias, encoder_length: int, final: nn.Module | None = None
    ) -> None:
        super().__init__(block, index, None)
        self._bias = Shared(bias)  # every layer of the stack reads the one table (copies of a layer too)
        self.decoder = bool(getattr(block, "is_decoder", False))
        self.encoder_length = encoder_length
        self.final = final

    @property
    def bias(self) -> RelativeBias:
        """The relative-position bias of the layer's stack."""
        return self._bias.value

    def _heads(self) -> slice:
        """The heads this rank computes: its tp or Ulysses group's share of them."""
        form = self.form
        group = None if form is None else form.region.group if form.region is not None else form.seq_group
        count = group_size(group)
        local = self.layer.layer[0].SelfAttention.n_heads // count  # type: ignore[index, union-attr]
        return slice(group_rank(group) * local, (group_rank(group) + 1) * local)

    def forward(self, hidden: Tensor) -> Tensor:
        form = self.form
        self._begin()
        with self._streams(hidden.device):
            if form is not None and form.seq_shards > 1:
                out = self._on_slice(hidden, form)
            else:
                out = self._on_stream(hidden)
        self._end()
        return out

    def _on_stream(self, hidden: Tensor) -> Tensor:
        """The whole sequence at hand: the block runs on its stream's rows."""
        n, heads = self.encoder_length, self._heads()
        enc, dec = hidden[:, :n], hidden[:, n:]
        if not self.decoder:
            enc = first_output(self.layer(enc, None, self.bias(n, enc.device, heads)))
            return torch.cat([enc if self.final is None else self.final(enc), dec], dim=1)
        bias = _causal(self.bias(dec.shape[1], dec.device, heads))
        region = None if self.form is None else self.form.region
        memory = enc if region is None else region.enter(enc)  # read by column-parallel keys and values
        dec = first_output(self.layer(dec, None, bias, memory, None, dec.new_zeros(1, 1, 1, 1)))
        return torch.cat([enc, dec], dim=1)

    def _on_slice(self, hidden: Tensor, form: ModuleForm) -> Tensor:
        """A block of the sequence (Megatron-SP, Ulysses): the block runs on every row of it, confined by the bias; the
        rows of its stream keep the output."""
        n, heads = self.encoder_length, self._heads()
        total, positions = form.positions(hidden.shape[1], hidden.device)
        assert positions is not None
        own = slice(n, total) if self.decoder else slice(0, n)
        length = own.stop - own.start
        bias = self.bias(length, hidden.device, heads)
        bias = _within(_causal(bias) if self.decoder else bias, own, total)
        if not self.decoder:
            out = first_output(self.layer(hidden, None, bias))
            out = out if self.final is None else self.final(out)
        elif form.ulysses:  # keys and values from this slice, whole after the all-to-all: the encoder's columns only
            cross = hidden.new_zeros(1, 1, 1, total)
            cross[..., n:] = _lowest(cross)
            out = first_output(self.layer(hidden, None, bias, hidden, None, cross))
        else:  # Megatron-SP: the encoder rows of the gathered stream
            assert form.region is not None
            memory = form.region.enter(hidden)[:, :n]
            out = first_output(self.layer(hidden, None, bias, memory, None, hidden.new_zeros(1, 1, 1, 1)))
        mine = (positions >= own.start) & (positions < own.stop)
        return torch.where(mine[None, :, None], out, hidden)


class T5Head(nn.Module):
    """The decoder's final norm and dropout, Hugging Face's output scaling, ``lm_head`` and the token loss, on the
    decoder part: ``(hidden, labels) -> (loss_sum, count)``."""

    def __init__(self, model: Any, encoder_length: int) -> None:
        super().__init__()
        self.final_layer_norm, self.dropout = model.decoder.final_layer_norm, model.decoder.dropout
        self.lm_head = model.lm_head
        self.encoder_length = encoder_length
        self.scale = model.model_dim**-0.5 if getattr(model.config, "scale_decoder_outputs", False) else 1.0

    def forward(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        hidden = self.dropout(self.final_layer_norm(hidden[:, self.encoder_length :]))
        return token_loss_sum(self.lm_head(hidden * self.scale if self.scale != 1.0 else hidden), labels)


class _Forms:
    """T5's parallel forms: a layer's is the table path's (``layers``: its parallelizer); the embedding and head stay
    whole (the constraints keep the vocabulary at degree 1)."""

    def __init__(self, layers: Any) -> None:
        self._layers = layers

    def layer(self, module: nn.Module, layer_type: str, ctx: ParallelContext) -> nn.Module:
        return self._layers.layer(module, layer_type, ctx)

    def embedding(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        return module

    def head(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        return module


_TABLE_PATH = "layer.0.SelfAttention.relative_attention_bias.weight"  # in each stack's first block


def cut(
    model: Any, parallelizer: Any, encoder_seq_length: int | None = None, decoder_seq_length: int | None = None
) -> LayeredModel:
    """``T5ForConditionalGeneration`` -> LayeredModel holding its modules; ``parallelizer``: the table path's, for the
    layers. ``encoder_seq_length`` fixes where the decoder part starts (``decoder_seq_length``, default the same,
    only completes the boundary length in the constraints)."""
    if encoder_seq_length is None:
        raise ValueError("t5: decompose needs encoder_seq_length (the split of [encoder ; decoder] positions)")
    layers: list[nn.Module] = []
    tables = []
    for stack in (model.encoder, model.decoder):
        stack.config._attn_implementation = model.config._attn_implementation  # each stack has a config copy
        first = len(layers)
        users = range(first, first + len(stack.block))
        name = "decoder" if stack.is_decoder else "encoder"
        table = SharedWeight(
            f"{name} relative-position table", stack.block[0].get_parameter(_TABLE_PATH), first,
            f"layer.{_TABLE_PATH}", users,
        )  # fmt: skip
        tables.append(table)
        bias = RelativeBias(table, stack.block[0].layer[0].SelfAttention)
        for i, block in enumerate(stack.block):
            last = not stack.is_decoder and i == len(stack.block) - 1
            final = nn.Sequential(stack.final_layer_norm, stack.dropout) if last else None
            layers.append(T5Layer(block, len(layers), bias, encoder_seq_length, final))
    n_enc = len(model.encoder.block)
    return LayeredModel(
        embedding=T5Embedding(model.shared, model.encoder.dropout),
        layers=layers,
        head=T5Head(model, encoder_seq_length),
        layer_types=[ENCODER] * n_enc + [DECODER] * (len(layers) - n_enc),
        parallelizer=_Forms(parallelizer),
        name="t5",
        constraints=constraints(model.config, encoder_seq_length, decoder_seq_length),
        shared=tables,
    )


def _num_decoder_layers(config: Any) -> int:
    return config.num_decoder_layers if config.num_decoder_layers is not None else config.num_layers


_NO_VOCAB_SPLIT = "t5 has no vocabulary-parallel embedding and head (the decoder part alone is scored)"


def constraints(config: Any, seq_length: int | None = None, decoder_seq_length: int | None = None) -> ModelConstraints:
    """Every layer form but context parallelism (tp, Megatron-SP, Ulysses, ZeRO-3, any stage division); the
    vocabulary at degree 1. Each stack's layers share its relative-position table. The boundary sequence is
    ``S_enc + S_dec`` when known (a sequence-sharding degree must divide it)."""
    total = seq_length + (decoder_seq_length or seq_length) if seq_length else None
    n_enc, n_dec = config.num_layers, _num_decoder_layers(config)
    return ModelConstraints(
        model_name="t5",
        layer_types=tuple(
            LayerTypeConstraints(name=name, num_layers=n, num_heads=config.num_heads, seq_length=total)
            for name, n in ((ENCODER, n_enc), (DECODER, n_dec))
        ),
        vocab_unsupported={ParallelForm.VOCAB_TP: _NO_VOCAB_SPLIT, ParallelForm.VOCAB_SP: _NO_VOCAB_SPLIT},
        shared_parameters=(
            SharedParameter(name="encoder relative-position table", layers=(0, n_enc - 1)),
            SharedParameter(name="decoder relative-position table", layers=(n_enc, n_enc + n_dec - 1)),
        ),
    )


def layer_specs(config: Any, seq_length: int, decoder_seq_length: int | None = None) -> list[LayerSpec]:
    """The boundary sequence is ``S_enc + S_dec`` for both layer types."""
    total = seq_length + (decoder_seq_length or seq_length)
    enc, dec = LayerSpec(ENCODER, total, config.d_model), LayerSpec(DECODER, total, config.d_model)
    return [enc] * config.num_layers + [dec] * _num_decoder_layers(config)


def set_num_layers(config: Any, num_layers: int) -> None:
    """``num_layers`` counts encoder plus decoder layers; they are split evenly."""
    if num_layers % 2:
        raise ValueError(f"t5: --num-layers {num_layers} must be even (encoder and decoder get half each)")
    config.num_layers = config.num_decoder_layers = num_layers // 2


_ATTENTION = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
_FFN = {"wi": "colwise", "wi_0": "colwise", "wi_1": "colwise", "wo": "rowwise"}  # plain or gated; absent ones skipped

TABLE: dict[str, Any] = {
    # paths inside a block of either stack: layer.0 self-attention; a decoder block's layer.1 cross-attention and
    # layer.2 feed-forward, an encoder block's layer.1 feed-forward
    "tp": {
        **{f"block.*.layer.0.SelfAttention.{p}": s for p, s in _ATTENTION.items()},
        **{f"block.*.layer.1.EncDecAttention.{p}": s for p, s in _ATTENTION.items()},
        **{f"block.*.layer.{i}.DenseReluDense.{p}": s for i in (1, 2) for p, s in _FFN.items()},
    },
    "pp": {"shared": None, "block": None, "lm_head": None},  # block: encoder.block, then decoder.block (cut)
    "layers": "block",
    "task": "seq2seq_lm",
    "cut": cut,
    # what the commands read: two stacks, heads sized by d_kv, the lengths shaping the boundary
    "facts": {
        "constraints": constraints,
        "layer_specs": layer_specs,
        "set_num_layers": set_num_layers,
        "ffn_size_field": "d_ff",
        "kv_heads_field": None,
        "head_dim_from_hidden": False,
    },
}
"""T5's entry in :data:`~galva_models.tables.plans.GALVA_TABLES`."""
