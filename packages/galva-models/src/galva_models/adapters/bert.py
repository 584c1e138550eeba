"""BERT for masked LM: embeddings (word + position + token type, LayerNorm), post-LN encoder layers, MLM head.

Galva modules:

- embedding ``HFEmbeddings``: ``embeddings`` = the Hugging Face ``BertEmbeddings``
- layer ``"bert"`` ``HFLayer``: ``layer`` = ``BertLayer`` (bidirectional attention, no padding mask)
- head ``MLMHead``: ``cls`` = ``BertOnlyMLMHead`` (transform + decoder tied to the word embeddings)

BERT has no final norm; the head's transform (dense, activation, LayerNorm) plays that part.

Vocabulary parallelism (:class:`BertParallelEmbedding`, :class:`BertVocabParallelHead`) keeps the Hugging Face
parameter names (``embeddings.word_embeddings.weight`` / ``cls.predictions.decoder.weight``), so galva-hp re-ties the
word embeddings and the MLM decoder by name across pipeline stages:

- vocab tp: the word table and the decoder are split over padded vocabulary rows (galva-hp's ``vocab_range``), the
  decoder bias with them; the loss is galva-hp's vocab-parallel cross-entropy. Position and token-type tables,
  the embedding LayerNorm and the head transform are replicated; under Megatron-SP they run on this rank's
  sequence slice (positions offset by the slice start) and their gradients are summed over the tp group.
- vocab sp: ids arrive as this rank's sequence slice: replicated embedding with offset positions, a copy of the head.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp import IGNORE_INDEX
from galva_hp.model import LayeredModel, ParallelContext
from galva_models.adapters.base import (
    FamilyAdapter,
    LayerSpec,
    SingleRankParallelizer,
    Task,
    set_num_hidden_layers,
    tie_and_check,
)
from galva_models.adapters.modules import HFEmbeddings, HFLayer, token_loss_sum
from galva_models.adapters.parallel import (
    PostNormLayer,
    dropout_form,
    encoder_attention_form,
    layer_norm_form,
    mlp_form,
    renamer,
    tp_group,
)
from galva_schema import ModelConstraints
from galva_schema.constraints import uniform_constraints

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


class MLMHead(nn.Module):
    def __init__(self, cls: nn.Module) -> None:
        super().__init__()
        self.cls = cls

    def forward(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        return token_loss_sum(self.cls(hidden), labels)


def _vocab_rows(tensor: Tensor, group: ProcessGroup | None) -> Tensor:
    """This rank's rows of the vocabulary-padded ``tensor`` (zeros in the padding), as galva-hp's vocab blocks hold."""
    from galva_hp.parallel.mappings import group_rank, group_size
    from galva_hp.parallel.vocab import vocab_range

    start, end, rows = vocab_range(tensor.shape[0], group_size(group), group_rank(group))
    local = tensor.new_zeros((rows, *tensor.shape[1:]))
    local[: end - start] = tensor[start:end].detach()
    return local


class _Holder(nn.Module):
    """A plain container, so parallel parameters keep their Hugging Face paths."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class WordEmbeddingShard(nn.Module):
    """The word table split over padded vocabulary rows (the rows galva-hp's ``VocabParallelEmbedding`` holds), with
    ``nn.Embedding``'s ``padding_idx`` rule (that id's row gets no gradient from the lookup). The output is summed
    over the group, or reduce-scattered along the sequence under Megatron-SP."""

    def __init__(self, word: nn.Embedding, group: ProcessGroup, sequence_parallel: bool) -> None:
        super().__init__()
        from galva_hp.parallel.mappings import group_rank, group_size
        from galva_hp.parallel.tensor_parallel import mark_tp_split
        from galva_hp.parallel.vocab import vocab_range

        self.group, self.sequence_parallel, self.vocab_size = group, sequence_parallel, word.weight.shape[0]
        self.start, self.end, _ = vocab_range(self.vocab_size, group_size(group), group_rank(group))
        pad = word.padding_idx
        self.local_pad = pad - self.start if pad is not None and self.start <= pad < self.end else None
        self.weight = nn.Parameter(_vocab_rows(word.weight, group))
        mark_tp_split(self.weight, 0, group)

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        from galva_hp.parallel.mappings import all_gather_along_dim
        from galva_hp.parallel.tensor_parallel import param_or_grad

        return {"weight": all_gather_along_dim(param_or_grad(self.weight, grads), 0, self.group)[: self.vocab_size]}

    def forward(self, input_ids: Tensor) -> Tensor:
        from galva_hp.parallel.tensor_parallel import exit_tp_region

        outside = (input_ids < self.start) | (input_ids >= self.end)
        local_ids = (input_ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, padding_idx=self.local_pad).masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp_region(out, self.group, self.sequence_parallel)


def _embedding_dropout(drop: nn.Module, offset_group: ProcessGroup | None) -> nn.Module:
    """Replicated embeddings draw one mask on every rank; a sequence slice draws its own (galva-hp's rng rule)."""
    if offset_group is None or not getattr(drop, "p", 0.0):
        return copy.deepcopy(drop)
    from galva_hp.parallel.rng import ShardedDropout

    return ShardedDropout(float(getattr(drop, "p", 0.0)), offset_group)


class BertParallelEmbedding(nn.Module):
    """``BertEmbeddings`` for a rank that holds a vocabulary shard (``word`` a :class:`WordEmbeddingShard`) and/or
    a slice of the sequence (``offset_group``: rank ``r`` holds positions ``[r*s_local, (r+1)*s_local)``).

    ``sum_grads``: the replicated tables and the LayerNorm meet a sequence slice while the runtime does not reduce
    them over that group (Megatron-SP), so their gradients are summed over it here. Token types are all 0, as in
    Hugging Face when no ``token_type_ids`` are given.
    """

    def __init__(
        self,
        embeddings: Any,
        word: nn.Module,
        offset_group: ProcessGroup | None = None,
        sum_grads: bool = False,
    ) -> None:
        super().__init__()
        from galva_hp.parallel.tensor_parallel import sequence_parallel_norm

        layer_norm = embeddings.LayerNorm
        norm = sequence_parallel_norm(layer_norm, offset_group) if sum_grads else copy.deepcopy(layer_norm)
        self.embeddings = _Holder(
            word_embeddings=word,
            position_embeddings=copy.deepcopy(embeddings.position_embeddings),
            token_type_embeddings=copy.deepcopy(embeddings.token_type_embeddings),
            LayerNorm=norm,
            dropout=_embedding_dropout(embeddings.dropout, offset_group),
        )
        self.offset_group, self.sum_grads = offset_group, sum_grads

    def forward(self, input_ids: Tensor) -> Tensor:
        from galva_hp.parallel.mappings import differentiable_copy_to_group, group_rank

        e: Any = self.embeddings
        words = e.word_embeddings(input_ids)
        b, local = words.shape[:2]
        offset = group_rank(self.offset_group) * local if self.offset_group is not None else 0
        positions = torch.arange(offset, offset + local, device=words.device)
        pos_table, type_table = e.position_embeddings.weight, e.token_type_embeddings.weight
        if self.sum_grads:
            pos_table, type_table = (
                differentiable_copy_to_group(pos_table, self.offset_group),
                differentiable_copy_to_group(type_table, self.offset_group),
            )
        types = torch.zeros((b, local), dtype=torch.long, device=words.device)
        hidden = words + F.embedding(types, type_table)  # Hugging Face's order of additions
        hidden = hidden + F.embedding(positions, pos_table).unsqueeze(0)
        return e.dropout(e.LayerNorm(hidden))


class BertVocabParallelHead(nn.Module):
    """The MLM head split over the vocabulary: transform (replicated; on the sequence slice with its gradient summed
    over the group under Megatron-SP), decoder rows and bias of this rank's vocabulary shard, galva-hp's
    vocab-parallel cross-entropy. Every token's loss is counted on one rank of the group (galva-hp's loss contract:
    token ``i`` on rank ``i % tp``, or the rank holding its sequence slice under Megatron-SP)."""

    def __init__(self, cls: Any, group: ProcessGroup, sequence_parallel: bool) -> None:
        super().__init__()
        from galva_hp.parallel.mappings import group_rank, group_size
        from galva_hp.parallel.tensor_parallel import column_parallel_linear, mark_tp_split, sequence_parallel_norm
        from galva_hp.parallel.vocab import vocab_range

        preds = cls.predictions
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tp, self.rank = group_size(group), group_rank(group)
        self.vocab_size = preds.decoder.weight.shape[0]
        self.start, self.end, _ = vocab_range(self.vocab_size, self.tp, self.rank)
        # the transform is per token: under Megatron-SP it runs on the slice with its gradient summed over the group
        transform = (
            sequence_parallel_norm(preds.transform, group) if sequence_parallel else copy.deepcopy(preds.transform)
        )
        decoder = column_parallel_linear(
            _vocab_rows(preds.decoder.weight, group), None, preds.decoder.in_features, group
        )
        bias = nn.Parameter(_vocab_rows(preds.decoder.bias, group))
        mark_tp_split(bias, 0, group)
        predictions = _Holder(transform=transform, decoder=decoder)
        predictions.register_parameter("bias", bias)  # Hugging Face's name of the decoder bias
        self.cls = _Holder(predictions=predictions)

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        """The single-process head's names (``cls.predictions.bias``, ``...transform.*``, ``...decoder.weight``)."""
        from galva_hp.parallel.mappings import all_gather_along_dim
        from galva_hp.parallel.tensor_parallel import gather_full_state, param_or_grad

        preds: Any = self.cls.predictions
        full = gather_full_state(preds.transform, grads, "cls.predictions.transform.")
        for name, param in (("bias", preds.bias), ("decoder.weight", preds.decoder.weight)):
            rows = all_gather_along_dim(param_or_grad(param, grads), 0, self.group)[: self.vocab_size]
            full[f"cls.predictions.{name}"] = rows
        return full

    def forward(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        from galva_hp.parallel.mappings import all_gather_along_dim, differentiable_copy_to_group
        from galva_hp.parallel.tensor_parallel import enter_tp_region
        from galva_hp.parallel.vocab import vocab_parallel_cross_entropy

        preds: Any = self.cls.predictions
        hidden = enter_tp_region(preds.transform(hidden), self.group, self.sequence_parallel)
        local_labels = labels
        if self.sequence_parallel:
            labels = all_gather_along_dim(labels, 1, self.group)
        logits = preds.decoder(hidden)[0] + preds.bias
        per_token = differentiable_copy_to_group(
            vocab_parallel_cross_entropy(logits, labels, self.group, self.start, self.end), self.group
        )
        if self.sequence_parallel:  # this rank's sequence slice
            s = local_labels.shape[1]
            positions = torch.arange(labels.shape[1], device=labels.device)
            owned = ((positions >= self.rank * s) & (positions < (self.rank + 1) * s)).expand_as(labels)
        else:
            owned = torch.arange(labels.numel(), device=labels.device).view_as(labels) % self.tp == self.rank
        owned = owned & (labels != IGNORE_INDEX)
        return (per_token * owned).sum(), owned.sum()


class BertParallelizer(SingleRankParallelizer):
    """Layers: Megatron tp (+SP) or Ulysses, bidirectional. Embedding and MLM head: vocab tp (+SP) or vocab sp."""

    def __init__(self, config: Any) -> None:
        super().__init__("bert", config)

    def embedding(self, module: Any, ctx: ParallelContext) -> nn.Module:
        embeddings = module.embeddings
        if ctx.tp_size > 1:
            word = WordEmbeddingShard(embeddings.word_embeddings, tp_group(ctx), ctx.megatron_sp)
            group = ctx.tp_group if ctx.megatron_sp else None
            return BertParallelEmbedding(embeddings, word, group, sum_grads=ctx.megatron_sp)
        if ctx.vocab_sp:  # replicated tables over the sequence slices: the runtime reduces them like dp
            return BertParallelEmbedding(embeddings, copy.deepcopy(embeddings.word_embeddings), ctx.sp_group)
        return module

    def head(self, module: Any, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size > 1:
            return BertVocabParallelHead(module.cls, tp_group(ctx), ctx.megatron_sp)
        return copy.deepcopy(module) if ctx.vocab_sp else module

    def layer(self, module: Any, layer_type: str, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size == 1 and ctx.sp_size == 1:
            return module
        layer = module.layer
        sa, out = layer.attention.self, layer.attention.output
        weights = (sa.query.weight, sa.key.weight, sa.value.weight, out.dense.weight)
        biases = (sa.query.bias, sa.key.bias, sa.value.bias, out.dense.bias)
        heads, p_attn = self.config.num_attention_heads, self.config.attention_probs_dropout_prob
        attention = encoder_attention_form(weights, biases, heads, ctx, dropout=p_attn)
        mlp = mlp_form(layer.intermediate.dense, layer.output.dense, layer.intermediate.intermediate_act_fn, ctx)
        return PostNormLayer(
            attention, layer_norm_form(out.LayerNorm, ctx), mlp, layer_norm_form(layer.output.LayerNorm, ctx),
            dropout_form(out.dropout, ctx), dropout_form(layer.output.dropout, ctx), rename=_BERT_NAMES,
        )  # fmt: skip


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import BertForMaskedLM

    return BertForMaskedLM._from_config(config, attn_implementation=attn_implementation)


def decompose(model: Any) -> LayeredModel:
    """``BertForMaskedLM`` -> LayeredModel sharing its modules."""
    bert = model.bert
    layers: list[nn.Module] = [HFLayer(layer) for layer in bert.encoder.layer]
    layered = LayeredModel(
        embedding=HFEmbeddings(bert.embeddings),
        layers=layers,
        head=MLMHead(model.cls),
        layer_types=["bert"] * len(layers),
        parallelizer=BertParallelizer(model.config),
        name="bert",
        constraints=constraints(model.config),
    )
    return tie_and_check(model, layered)


def constraints(config: Any, seq_length: int | None = None, decoder_seq_length: int | None = None) -> ModelConstraints:
    """Every form runs; learned positions bound the sequence."""
    return uniform_constraints(
        "bert",
        "bert",
        config.num_hidden_layers,
        config.num_attention_heads,
        max_seq_length=config.max_position_embeddings,
    )


def layer_specs(config: Any, seq_length: int) -> list[LayerSpec]:
    return [LayerSpec("bert", seq_length, config.hidden_size)] * config.num_hidden_layers


ADAPTER = FamilyAdapter(
    name="bert", model_types=("bert",), task=Task.MASKED_LM,
    build_model=build_model, decompose=decompose, constraints=constraints, layer_specs=layer_specs,
    set_num_layers=set_num_hidden_layers, ffn_size_field="intermediate_size",
)  # fmt: skip
