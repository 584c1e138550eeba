"""The parallel forms of a model cut from its tables, applied in place (galva-hp's ``Parallelizer``).

- A layer under tp: each module the tp table names takes its style (:mod:`.sharding`); attention modules learn
  which key/value heads they read when those are replicated; under Megatron-SP the layer's boundaries are
  sequence slices (the attention and MLP blocks gather their input, the row-parallel modules reduce-scatter) and
  the gradient of every replicated parameter outside those blocks (norms, row-parallel biases) is summed over tp;
  inside a block, under either, one used on this rank's features only is summed too (``sum_where_sharded``).
- A layer under Ulysses: weights unchanged; its attention modules exchange sequence for heads
  (:mod:`.attention`), and each rank's position embeddings are those of its slice.
- Embedding and head under vocabulary tp: the token table and ``lm_head`` split over the vocabulary (padded),
  the loss vocabulary-parallel; under vocabulary sp, this rank's slice of the positions.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed import ProcessGroup

from galva_hp.model import ParallelContext
from galva_hp.parallel.mappings import group_rank
from galva_models.tables.attention import AttentionForm
from galva_models.tables.modules import ModuleForm, TableEmbedding, TableHead, TableLayer
from galva_models.tables.plans import ModelTables
from galva_models.tables.sharding import (
    TpRegion,
    enter_region_at,
    shard_linear,
    split_embedding,
    split_vocab_rows,
    sum_where_sharded,
)

__all__ = ["TableParallelizer", "attention_paths", "head_counts"]


def head_counts(config: Any) -> tuple[int, int, int]:
    """``(heads, key/value heads, head size)`` of a config."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv, head_dim


def _is_attention(path: str) -> bool:
    return "attn" in path.lower() or "attention" in path.lower()


def attention_paths(tables: ModelTables) -> list[str]:
    """The attention modules of a layer (paths in it), as its tp table names them: where a form is attached."""
    return sorted({p.rsplit(".", 1)[0] for p in tables.tp if "." in p and _is_attention(p)})


def _split_names(module: nn.Module) -> set[str]:
    return {n for n, p in module.named_parameters() if getattr(p, "galva_split", None) is not None}


class TableParallelizer:
    """In-place parallel forms of :class:`~.modules.TableEmbedding`, :class:`~.modules.TableLayer` and
    :class:`~.modules.TableHead` (each converted once: the module itself is returned)."""

    def __init__(self, config: Any, tables: ModelTables) -> None:
        self.config, self.tables = config, tables

    def layer(self, module: nn.Module, layer_type: str, ctx: ParallelContext) -> nn.Module:
        assert isinstance(module, TableLayer)
        if ctx.tp_size == 1 and ctx.sp_size == 1 and ctx.cp_size == 1:
            return module
        _once(module)
        attention = attention_paths(self.tables)
        if ctx.cp_size > 1 and not attention:  # the constraints refuse this; a ring left out would be silent
            raise ValueError(f"{self.config.model_type}: no attention module in its tp table to run the ring in")
        if ctx.tp_size == 1:  # Ulysses and / or context parallelism: weights whole
            for path in attention:
                module.layer.get_submodule(path).galva_attention = AttentionForm(  # type: ignore[assignment]
                    sp_group=ctx.sp_group, heads_group=ctx.sp_group, cp_group=ctx.cp_group, cp_index=ctx.cp_index
                )
            ulysses = ctx.sp_size > 1
            module.form = ModuleForm(
                seq_group=ctx.sp_group, seq_shards=ctx.sp_size, ulysses=ulysses, cp=ctx.cp_size, cp_index=ctx.cp_index
            )
            return module
        group = ctx.tp_group
        assert group is not None
        tp, rank = ctx.tp_size, group_rank(group)
        sequence_parallel = ctx.sequence_parallel_tp
        region = TpRegion(group, sequence_parallel)
        heads, kv, head_dim = head_counts(self.config)
        replicate_kv = kv < heads and tp > kv
        summed: set[str] = set()
        replicated_kv = False  # key/value projections kept whole: each rank reads its heads in attention
        entries = {p.rsplit(".", 1)[0] for p, st in self.tables.tp.items() if "colwise" in st and "." in p}
        for path in sorted(entries):
            block = _find(module.layer, path)
            if block is not None:
                enter_region_at(block, region)
        for path, style in self.tables.tp.items():
            sub = _find(module.layer, path)
            if sub is None:  # an optional module this config does not build (e.g. a bias-free norm)
                continue
            prefix = f"layer.{path}."
            if style == "replicated_with_grad_allreduce":
                summed |= {prefix + n for n, _ in sub.named_parameters()}
                continue
            is_kv = _is_attention(path) and isinstance(sub, nn.Linear) and sub.out_features == kv * head_dim
            keep = replicate_kv and is_kv and style == "colwise"
            replicated_kv |= keep
            blocks = self.tables.blocks.get(path, 2)
            summed |= {prefix + n for n in shard_linear(sub, style, region, path, replicate=keep, blocks=blocks)}
        for attribute in self.tables.per_rank:  # features counted per rank (a packed projection's split size)
            owner_path, _, name = attribute.rpartition(".")
            owner = _find(module.layer, owner_path) if owner_path else module.layer
            if owner is not None:
                setattr(owner, name, getattr(owner, name) // tp)
        for path in attention:
            # heads are this rank's only where the block's projections stay split (not gathered back: Phi-3, Olmo 2)
            styles = [st for p, st in self.tables.tp.items() if p.startswith(path + ".")]
            heads_split = any(st in ("colwise", "packed_colwise") for st in styles)
            if not heads_split and ctx.cp_size == 1:
                continue
            first = (rank * (heads // tp)) // (heads // kv)
            module.layer.get_submodule(path).galva_attention = AttentionForm(  # type: ignore[assignment]
                kv_heads=(first, 1) if replicated_kv and heads_split else None,
                heads_group=group if heads_split else None,
                cp_group=ctx.cp_group,
                cp_index=ctx.cp_index,
            )
        for path in sorted(entries):
            block = _find(module.layer, path)
            if block is not None:
                inner = {p[len(path) + 1 :]: st for p, st in self.tables.tp.items() if p.startswith(path + ".")}
                sum_where_sharded(block, {p: st for p, st in inner.items() if _find(block, p) is not None}, group)
        if sequence_parallel:  # replicated parameters outside the blocks (norms, row-parallel biases) see a slice
            split = _split_names(module)
            inside = tuple(f"layer.{path}." for path in entries)
            biases = {f"layer.{p}.bias" for p, st in self.tables.tp.items() if "rowwise" in st}
            summed |= {
                n for n, _ in module.named_parameters() if n not in split and (not n.startswith(inside) or n in biases)
            }
        module.form = ModuleForm(
            region=region,
            grad_sums=[(n, group) for n in sorted(summed)],
            seq_group=group if sequence_parallel else None,
            seq_shards=tp if sequence_parallel else 1,
            cp=ctx.cp_size,
            cp_index=ctx.cp_index,
        )
        return module

    def embedding(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        assert isinstance(module, TableEmbedding)
        if ctx.tp_size > 1:
            _once(module)
            group = ctx.tp_group
            assert group is not None
            tp = ctx.tp_size
            sequence_parallel = ctx.sequence_parallel_tp
            name = self.tables.before[0]
            split_embedding(getattr(module, name), group, sequence_parallel, name)
            module.form = ModuleForm(
                grad_sums=_slice_sums(module, group) if sequence_parallel else [],
                seq_group=group if sequence_parallel else None,
                seq_shards=tp if sequence_parallel else 1,  # learned positions: this rank's slice (GPT-2's wpe)
                cp=ctx.cp_size,
                cp_index=ctx.cp_index,
            )
        elif (ctx.vocab_sp and ctx.sp_size > 1) or ctx.cp_size > 1:
            _once(module)
            module.form = ModuleForm(
                seq_group=ctx.sp_group, seq_shards=ctx.sp_size, ulysses=True, cp=ctx.cp_size, cp_index=ctx.cp_index
            )
        return module

    def head(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        assert isinstance(module, TableHead)
        if ctx.tp_size > 1:
            _once(module)
            group = ctx.tp_group
            assert group is not None
            sequence_parallel = ctx.sequence_parallel_tp
            region = TpRegion(group, sequence_parallel)
            lm_head = module.lm_head
            vocab = self.config.get_text_config().vocab_size
            split_vocab_rows(lm_head, ("weight", "bias"), group, vocab)
            enter_region_at(lm_head, region)
            module.form = ModuleForm(
                region=region,
                grad_sums=_slice_sums(module, group) if sequence_parallel else [],
                seq_group=group if sequence_parallel else None,
                vocab_group=group,
            )
        elif ctx.vocab_sp and ctx.sp_size > 1:
            _once(module)
            module.form = ModuleForm(seq_group=ctx.sp_group)
        return module


def _slice_sums(module: nn.Module, group: ProcessGroup) -> list[tuple[str, ProcessGroup]]:
    """Under Megatron-SP, every parameter of a vocabulary module that is not split sees this rank's sequence slice:
    its gradient is summed over tp."""
    split = _split_names(module)
    return [(n, group) for n, _ in module.named_parameters() if n not in split]


def _find(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _once(module: Any) -> None:
    if module.form is not None:
        raise ValueError(f"{type(module).__name__} is already in a parallel form (forms are applied in place, once)")
