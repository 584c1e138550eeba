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
computes it itself (:class:`RelativeBias`) from the stack's one ``relative_attention_bias`` table, a galva-hp shared
parameter (:class:`~galva_hp.shared_params.SharedWeight`): registered in the stack's first layer (inside its Hugging
Face block, so names, initialisation and checkpoints see it there) and read by every layer of the stack. galva-hp
gives every rank whose stage runs one of those layers a copy and sums its gradient over them, so a stack may span
several stages, its layers may use different tp layouts, and ZeRO-3 shards the layers but not the table.

Tensor parallelism (:class:`T5TPEncoderLayer` / :class:`T5TPDecoderLayer`): Megatron column-parallel q / k / v over
heads and row-parallel o in self- and cross-attention (:class:`T5TPAttention`, T5's unscaled scores plus the additive
position bias), the FFN (``DenseReluDense`` or gated-gelu) column/row-parallel, T5's RMS-style norms replicated. Each
rank's bias reads its heads' columns of the whole table (:meth:`RelativeBias.for_heads`).

Sequence sharding (Megatron-SP and Ulysses): the boundary is cut into contiguous blocks of ``[encoder ; decoder]``
like any other, so a rank's block may hold rows of both streams. The layer picks its stream's rows where the whole
sequence is at hand, and returns zeros on the other stream's rows: Megatron-SP all-gathers the normalised block, runs
attention and FFN on the stream's rows and reduce-scatters the partial outputs (zero elsewhere) back to the blocks;
Ulysses trades the block of every head for the whole sequence of this rank's heads around each attention, and runs
the per-token parts (norms, FFN, the encoder's final norm) on the block's rows of its stream.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.model import LayeredModel, ParallelContext
from galva_hp.shared_params import SharedWeight
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
    """A stack's bucketed relative-position bias ``[1, heads, q, k]`` (same maths as ``T5Attention``), read from the
    stack's shared table (a :class:`~galva_hp.shared_params.SharedWeight`, see the module docstring); ``heads``
    restricts it to a slice of the heads (a tensor-parallel or Ulysses rank's)."""

    def __init__(
        self,
        table: SharedWeight,
        bidirectional: bool,
        num_buckets: int,
        max_distance: int,
        bucket: Callable[..., Tensor],
        heads: slice | None = None,
    ) -> None:
        super().__init__()
        self._table = (table,)  # a tuple: a plain reference, copied by no deepcopy of a layer
        self.bidirectional, self.num_buckets, self.max_distance = bidirectional, num_buckets, max_distance
        self._bucket = bucket
        self.heads = heads

    @classmethod
    def of(cls, attention: Any, table: SharedWeight) -> RelativeBias:
        """The bias of a Hugging Face ``T5Attention`` whose table is ``table``."""
        return cls(
            table,
            not attention.is_decoder,
            attention.relative_attention_num_buckets,
            attention.relative_attention_max_distance,
            type(attention)._relative_position_bucket,
        )

    @property
    def table(self) -> SharedWeight:
        return self._table[0]

    def for_heads(self, group: ProcessGroup) -> RelativeBias:
        """The same bias for this rank's ``1/n`` of the heads (its columns of the table; the table stays whole)."""
        from galva_hp.parallel.mappings import group_rank, group_size

        n, rank = group_size(group), group_rank(group)
        heads = self.table.param.shape[1]
        if heads % n:
            raise ValueError(f"t5: {n} ranks do not divide the {heads} attention heads")
        local = heads // n
        return RelativeBias(
            self.table, self.bidirectional, self.num_buckets, self.max_distance, self._bucket,
            slice(rank * local, (rank + 1) * local),
        )  # fmt: skip

    def forward(self, length: int, device: torch.device) -> Tensor:
        pos = torch.arange(length, dtype=torch.long, device=device)
        relative = pos[None, :] - pos[:, None]
        buckets = self._bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        table = self.table.value()
        if self.heads is not None:
            table = table[:, self.heads]  # this rank's heads: its share of the table's gradient
        return F.embedding(buckets, table).permute(2, 0, 1).unsqueeze(0)


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

    Self-attention reads keys and values from its input, cross-attention from ``memory`` (the encoder output). The
    relative-position table is not here: every layer reads the stack's shared table through its bias.
    """

    def __init__(self, attention: Any, group: ProcessGroup) -> None:
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

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        """Hugging Face's ``q / k / v / o`` tensors, assembled over the tp group."""
        from galva_hp.parallel.mappings import all_gather_along_dim
        from galva_hp.parallel.tensor_parallel import param_or_grad

        full = {"q.weight": all_gather_along_dim(param_or_grad(self.q.weight, grads), 0, self.group)}
        for name, part in zip(("k", "v"), param_or_grad(self.kv.weight, grads).chunk(2)):
            full[f"{name}.weight"] = all_gather_along_dim(part, 0, self.group)
        full["o.weight"] = all_gather_along_dim(param_or_grad(self.o.weight, grads), 1, self.group)
        return full

    def partial(self, x: Tensor, bias: Tensor | None, memory: Tensor | None = None) -> Tensor:
        """This rank's partial output (before the sum over tp) for inputs already inside the tp region."""
        source = x if memory is None else memory
        (b, s), s_kv = x.shape[:2], source.shape[1]
        q = self.q(x)[0].view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k, v = (
            t.view(b, s_kv, self.local_heads, self.head_dim).transpose(1, 2) for t in self.kv(source)[0].chunk(2, -1)
        )
        from galva_hp.parallel.rng import rank_stream

        dropout = self.dropout if self.training else 0.0
        with rank_stream(self.group, x.device) if dropout else contextlib.nullcontext():  # this rank's heads
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=1.0)
        return F.linear(out.transpose(1, 2).reshape(b, s, -1), self.o.weight)

    def forward(self, x: Tensor, bias: Tensor | None, memory: Tensor | None = None) -> Tensor:
        from galva_hp.parallel.tensor_parallel import enter_tp_region, exit_tp_region

        x = enter_tp_region(x, self.group, False)
        memory = None if memory is None else enter_tp_region(memory, self.group, False)
        return exit_tp_region(self.partial(x, bias, memory), self.group, False)


class _Activation(nn.Module):
    """T5's FFN middle: ``dropout(act(h))``, or ``dropout(act(gate) * up)`` for the gated form. ``dropout`` is used
    as given: under tp the middle is split over the ranks, so it is a ``ShardedDropout`` (a mask per rank)."""

    def __init__(self, act: nn.Module, dropout: nn.Module) -> None:
        super().__init__()
        self.act, self.dropout = copy.deepcopy(act), dropout

    def forward(self, h: Tensor, up: Tensor | None = None) -> Tensor:
        h = self.act(h)
        return self.dropout(h if up is None else h * up)


def _ffn_form(ff: Any, group: ProcessGroup) -> Any:
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


def _ffn_partial(mlp: Any, x: Tensor) -> Tensor:
    """A tp FFN's partial output (before the sum over tp) for an input already inside the tp region."""
    parts = mlp.up(x)[0].split(mlp.local_sizes, dim=-1)
    return F.linear(mlp.activation(*parts), mlp.down.weight)


class _SubLayer(nn.Module):
    """One T5 sub-layer ``x + dropout(inner(layer_norm(x), ...))``; ``inner`` is registered under Hugging Face's
    name (``SelfAttention``, ``EncDecAttention``, ``DenseReluDense``), so the gathered state has its names.

    ``sequence_group``: the boundaries hold a sequence slice over this group (Megatron-SP), so the norm's weight
    gradient is summed over it and the residual dropout draws a mask per rank."""

    def __init__(self, sub: Any, inner_name: str, inner: nn.Module, sequence_group: ProcessGroup | None) -> None:
        super().__init__()
        self.layer_norm = copy.deepcopy(sub.layer_norm)  # replicated over tp (it sees the full hidden)
        self.add_module(inner_name, inner)
        self.dropout = _slice_dropout(sub.dropout, sequence_group)
        self._inner = inner_name
        self.sequence_group = sequence_group

    @property
    def inner(self) -> Any:
        return getattr(self, self._inner)

    def norm(self, x: Tensor) -> Tensor:
        return _norm(self.layer_norm, x, self.sequence_group)

    def forward(self, x: Tensor, *args: Tensor | None) -> Tensor:
        return x + self.dropout(self.inner(self.norm(x), *args))


def _slice_dropout(dropout: nn.Module, group: ProcessGroup | None) -> nn.Module:
    """A copy of ``dropout``; a mask per rank when it acts on a sequence slice over ``group``."""
    from galva_hp.parallel.rng import ShardedDropout

    p = float(getattr(dropout, "p", 0.0))
    return ShardedDropout(p, group) if group is not None and p else copy.deepcopy(dropout)


def _norm(norm: nn.Module, x: Tensor, group: ProcessGroup | None) -> Tensor:
    """``norm(x)``; on a sequence slice over ``group`` its weight gradient is summed over the group."""
    if group is None:
        return norm(x)
    from galva_hp.parallel.mappings import differentiable_copy_to_group

    weights = {name: differentiable_copy_to_group(p, group) for name, p in norm.named_parameters()}
    out: Tensor = torch.func.functional_call(norm, weights, (x,))
    return out


class _Block(nn.Module):
    """Holds the sub-layers as ``layer.<i>`` like ``T5Block``."""

    def __init__(self, subs: list[nn.Module]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(subs)


def _slice_rows(total_local: int, start: int, stop: int, group: ProcessGroup | None) -> slice:
    """The rows of this rank's contiguous sequence slice (``total_local`` rows) that fall in ``[start, stop)``."""
    from galva_hp.parallel.mappings import group_rank

    first = group_rank(group) * total_local
    return slice(min(max(start - first, 0), total_local), min(max(stop - first, 0), total_local))


def _rows_back(out: Tensor, rows: slice, total: int) -> Tensor:
    """``out`` (rows ``rows`` of a ``total``-row sequence along dim 1) with zero rows around it."""
    pad = [0, 0] * (out.dim() - 2) + [rows.start, total - rows.stop]
    return F.pad(out, pad)


class T5TPEncoderLayer(nn.Module):
    """Tensor-parallel ``"t5_encoder"`` layer; gathers to :class:`T5EncoderLayer`'s names (``block.layer.0...``).

    With Megatron-SP (``sequence_parallel``) the boundary holds this rank's contiguous slice of
    ``[encoder ; decoder]``, which may hold rows of both streams: the normalised slice is all-gathered, the
    attention and the FFN run on the encoder rows, their partial outputs (zero on the decoder rows) are
    reduce-scattered back to the slices, and the final norm applies to the slice's encoder rows only."""

    def __init__(self, layer: T5EncoderLayer, bias: RelativeBias, group: ProcessGroup, sequence_parallel: bool) -> None:
        super().__init__()
        hf: Any = layer.block.layer  # the Hugging Face sub-layers
        seq = group if sequence_parallel else None
        attention = T5TPAttention(hf[0].SelfAttention, group)
        ffn = _ffn_form(hf[1].DenseReluDense, group)
        self.block = _Block(
            [_SubLayer(hf[0], "SelfAttention", attention, seq), _SubLayer(hf[1], "DenseReluDense", ffn, seq)]
        )
        self.bias = bias
        self.encoder_length = layer.encoder_length
        final: Any = copy.deepcopy(layer.final)
        if final is not None and seq is not None:
            final[1] = _slice_dropout(final[1], seq)
        self.final = final
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, hidden: Tensor) -> Tensor:
        if self.sequence_parallel:
            return self._sequence_parallel(hidden)
        enc, dec = hidden[:, : self.encoder_length], hidden[:, self.encoder_length :]
        enc = self.block.layer[0](enc, self.bias(enc.shape[1], enc.device))
        enc = self.block.layer[1](enc)
        if self.final is not None:
            enc = self.final(enc)
        return torch.cat([enc, dec], dim=1)

    def _sequence_parallel(self, hidden: Tensor) -> Tensor:
        from galva_hp.parallel.tensor_parallel import enter_tp_region, exit_tp_region

        group, length = self.group, self.encoder_length
        layers: Any = self.block.layer
        attn, ffn = layers
        total = hidden.shape[1] * _size(group)
        enc = slice(0, length)
        x = enter_tp_region(attn.norm(hidden), group, True)[:, enc]
        partial = attn.inner.partial(x, self.bias(length, hidden.device))
        hidden = hidden + attn.dropout(exit_tp_region(_rows_back(partial, enc, total), group, True))
        x = enter_tp_region(ffn.norm(hidden), group, True)[:, enc]
        partial = _ffn_partial(ffn.inner, x)
        hidden = hidden + ffn.dropout(exit_tp_region(_rows_back(partial, enc, total), group, True))
        if self.final is None:
            return hidden
        mine = _slice_rows(hidden.shape[1], 0, length, group)
        final_sequence: Any = self.final
        norm, dropout = final_sequence
        final = dropout(_norm(norm, hidden[:, mine], group))
        return torch.cat([final, hidden[:, mine.stop :]], dim=1)


class T5TPDecoderLayer(nn.Module):
    """Tensor-parallel ``"t5_decoder"`` layer: self-attention, cross-attention to the encoder part, FFN. With
    Megatron-SP as :class:`T5TPEncoderLayer` does, on the decoder rows; the cross-attention's keys and values come
    from the all-gathered encoder rows of the layer's input."""

    def __init__(self, layer: T5DecoderLayer, bias: RelativeBias, group: ProcessGroup, sequence_parallel: bool) -> None:
        super().__init__()
        hf: Any = layer.block.layer
        seq = group if sequence_parallel else None
        self.block = _Block(
            [
                _SubLayer(hf[0], "SelfAttention", T5TPAttention(hf[0].SelfAttention, group), seq),
                _SubLayer(hf[1], "EncDecAttention", T5TPAttention(hf[1].EncDecAttention, group), seq),
                _SubLayer(hf[2], "DenseReluDense", _ffn_form(hf[2].DenseReluDense, group), seq),
            ]
        )
        self.bias = bias
        self.encoder_length = layer.encoder_length
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, hidden: Tensor) -> Tensor:
        if self.sequence_parallel:
            return self._sequence_parallel(hidden)
        enc, dec = hidden[:, : self.encoder_length], hidden[:, self.encoder_length :]
        dec = self.block.layer[0](dec, _causal(self.bias(dec.shape[1], dec.device)))
        dec = self.block.layer[1](dec, None, enc)  # no position bias in cross-attention
        dec = self.block.layer[2](dec)
        return torch.cat([enc, dec], dim=1)

    def _sequence_parallel(self, hidden: Tensor) -> Tensor:
        from galva_hp.parallel.tensor_parallel import enter_tp_region, exit_tp_region

        group, length = self.group, self.encoder_length
        layers: Any = self.block.layer
        attn, cross, ffn = layers
        total = hidden.shape[1] * _size(group)
        dec = slice(length, total)
        memory = enter_tp_region(hidden, group, True)[:, :length]  # the encoder output, unchanged by this layer
        x = enter_tp_region(attn.norm(hidden), group, True)[:, dec]
        partial = attn.inner.partial(x, _causal(self.bias(total - length, hidden.device)))
        hidden = hidden + attn.dropout(exit_tp_region(_rows_back(partial, dec, total), group, True))
        x = enter_tp_region(cross.norm(hidden), group, True)[:, dec]
        partial = cross.inner.partial(x, None, memory)
        hidden = hidden + cross.dropout(exit_tp_region(_rows_back(partial, dec, total), group, True))
        x = enter_tp_region(ffn.norm(hidden), group, True)[:, dec]
        partial = _ffn_partial(ffn.inner, x)
        return hidden + ffn.dropout(exit_tp_region(_rows_back(partial, dec, total), group, True))


def _size(group: ProcessGroup | None) -> int:
    from galva_hp.parallel.mappings import group_size

    return group_size(group)


# ------------------------------------------------------------------------------------------------- Ulysses form
class T5UlyssesLayer(nn.Module):
    """Ulysses ``"t5_encoder"`` / ``"t5_decoder"`` layer: the boundary holds this rank's contiguous slice of
    ``[encoder ; decoder]``; weights are replicated (a copy of the Hugging Face block, same names). Around each
    attention an all-to-all trades the slice of every head for the whole sequence of this rank's heads; the stream's
    rows are picked there, and the output (zero on the other stream's rows) goes back by the inverse all-to-all. The
    per-token parts (norms, FFN, the encoder's final norm) run on the slice's rows of the layer's stream."""

    def __init__(self, layer: T5EncoderLayer | T5DecoderLayer, bias: RelativeBias, group: ProcessGroup) -> None:
        super().__init__()
        self.block = copy.deepcopy(layer.block)
        self.bias = bias
        self.encoder_length = layer.encoder_length
        self.final = copy.deepcopy(layer.final) if isinstance(layer, T5EncoderLayer) else None
        self.decoder = isinstance(layer, T5DecoderLayer)
        self.group = group
        self._dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in self.block.modules())

    def _attention(
        self, attention: Any, x: Tensor, rows: slice, bias: Tensor | None, memory: Tensor | None, keys: slice
    ) -> Tensor:
        """``attention`` (a Hugging Face ``T5Attention``) of the ``rows`` of ``x`` over the ``keys`` rows of
        ``memory`` (or of ``x``), for inputs sharded along the sequence; zero on the other rows."""
        from galva_hp.parallel.mappings import differentiable_all_to_all
        from galva_hp.parallel.rng import rank_stream

        group, heads, dim = self.group, attention.n_heads, attention.key_value_proj_dim
        source = x if memory is None else memory
        b, local = x.shape[:2]
        total = local * _size(group)

        def whole(t: Tensor, part: slice) -> Tensor:  # [b, local, heads*d] -> [b, heads/n, rows, d]
            t = differentiable_all_to_all(t.view(b, local, heads, dim), 2, 1, group)
            return t[:, part].transpose(1, 2)

        q = whole(attention.q(x), rows)
        k, v = whole(attention.k(source), keys), whole(attention.v(source), keys)
        dropout = float(attention.dropout) if self.training else 0.0
        with rank_stream(group, x.device) if dropout else contextlib.nullcontext():  # this rank's heads
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=1.0)
        out = _rows_back(out.transpose(1, 2), rows, total)  # [b, total, heads/n, d]
        out = differentiable_all_to_all(out, 1, 2, group).reshape(b, local, heads * dim)
        return attention.o(out)

    def forward(self, hidden: Tensor) -> Tensor:
        from galva_hp.parallel.rng import rank_stream

        with rank_stream(self.group, hidden.device) if self.training and self._dropout else contextlib.nullcontext():
            return self._decoder(hidden) if self.decoder else self._encoder(hidden)  # dropout masks per slice

    def _encoder(self, hidden: Tensor) -> Tensor:
        hf: Any = self.block.layer
        length = self.encoder_length
        enc = slice(0, length)
        bias = self.bias(length, hidden.device)
        hidden = hidden + hf[0].dropout(
            self._attention(hf[0].SelfAttention, hf[0].layer_norm(hidden), enc, bias, None, enc)
        )
        mine = _slice_rows(hidden.shape[1], 0, length, self.group)
        rows = hf[1](hidden[:, mine])  # T5LayerFF: x + dropout(ffn(norm(x)))
        if self.final is not None:
            rows = self.final(rows)
        return torch.cat([rows, hidden[:, mine.stop :]], dim=1)

    def _decoder(self, hidden: Tensor) -> Tensor:
        hf: Any = self.block.layer
        length, total = self.encoder_length, hidden.shape[1] * _size(self.group)
        enc, dec = slice(0, length), slice(length, total)
        bias = _causal(self.bias(total - length, hidden.device))
        memory = hidden  # the encoder rows are the encoder output, unchanged by this layer
        hidden = hidden + hf[0].dropout(
            self._attention(hf[0].SelfAttention, hf[0].layer_norm(hidden), dec, bias, None, dec)
        )
        cross = self._attention(hf[1].EncDecAttention, hf[1].layer_norm(hidden), dec, None, memory, enc)
        hidden = hidden + hf[1].dropout(cross)
        mine = _slice_rows(hidden.shape[1], length, total, self.group)
        return torch.cat([hidden[:, : mine.start], hf[2](hidden[:, mine])], dim=1)


class T5Parallelizer(SingleRankParallelizer):
    """Layers: Megatron tp with or without Megatron-SP, or Ulysses (see the module docstring); each layer's bias
    reads its stack's shared table, sliced to the heads the rank computes. Embedding and head: degree 1."""

    def __init__(self, config: Any) -> None:
        super().__init__("t5", config)

    def layer(self, module: Any, layer_type: str, ctx: ParallelContext) -> nn.Module:
        if ctx.sp_group is not None and ctx.sp_size > 1:
            return T5UlyssesLayer(module, module.bias.for_heads(ctx.sp_group), ctx.sp_group)
        if ctx.tp_size == 1:
            return module
        group = tp_group(ctx)
        bias = module.bias.for_heads(group)
        form = T5TPEncoderLayer if layer_type == "t5_encoder" else T5TPDecoderLayer
        return form(module, bias, group, ctx.sequence_parallel_tp)


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration._from_config(config, attn_implementation=attn_implementation)


def decompose(model: Any, encoder_seq_length: int | None = None, decoder_seq_length: int | None = None) -> LayeredModel:
    """``T5ForConditionalGeneration`` -> LayeredModel; ``encoder_seq_length`` fixes where the decoder part starts
    (``decoder_seq_length``, default the same, only completes the boundary length in the constraints)."""
    if encoder_seq_length is None:
        raise ValueError("t5: decompose needs encoder_seq_length (the split of [encoder ; decoder] positions)")
    enc, dec = model.encoder, model.decoder
    n_enc, n_dec = len(enc.block), len(dec.block)
    path = "block.layer.0.SelfAttention.relative_attention_bias.weight"  # in each stack's first layer
    tables = [
        SharedWeight(f"{name} relative-position table", stack.block[0].get_parameter(path[6:]), first, path, users)
        for name, stack, first, users in (
            ("encoder", enc, 0, range(n_enc)),
            ("decoder", dec, n_enc, range(n_enc, n_enc + n_dec)),
        )
    ]
    enc_bias = RelativeBias.of(enc.block[0].layer[0].SelfAttention, tables[0])
    dec_bias = RelativeBias.of(dec.block[0].layer[0].SelfAttention, tables[1])
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
        shared=tables,
    )
    return tie_and_check(model, layered)


def _num_decoder_layers(config: Any) -> int:
    return config.num_decoder_layers if config.num_decoder_layers is not None else config.num_layers


_NO_VOCAB_SPLIT = "t5 has no vocabulary-parallel embedding and head (the decoder part alone is scored)"


def constraints(config: Any, seq_length: int | None = None, decoder_seq_length: int | None = None) -> ModelConstraints:
    """Every layer form (tp, Megatron-SP, Ulysses, ZeRO-3, any stage division); the vocabulary layers at degree 1.
    Each stack's layers share its relative-position table (galva-hp sums its gradient wherever they run). The
    boundary sequence is ``S_enc + S_dec`` when known (a sequence-sharding degree must divide it)."""
    total = seq_length + (decoder_seq_length or seq_length) if seq_length else None
    n_enc, n_dec = config.num_layers, _num_decoder_layers(config)
    stacks = (("t5_encoder", n_enc), ("t5_decoder", n_dec))
    return ModelConstraints(
        model_name="t5",
        layer_types=tuple(
            LayerTypeConstraints(name=name, num_layers=n, num_heads=config.num_heads, seq_length=total)
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
