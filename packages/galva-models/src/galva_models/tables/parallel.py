"""The parallel forms of a model cut from its tables, applied in place (galva-hp's ``Parallelizer``).

- A layer under tp: each module the tp table names takes its style (:mod:`.sharding`); attention modules learn
  which key/value heads they read when those are replicated; under Megatron-SP the layer's boundaries are
  sequence slices (the attention and MLP blocks gather their input, the row-parallel modules reduce-scatter) and
  the gradient of every replicated parameter outside those blocks (norms, row-parallel biases) is summed over tp;
  inside a block, under either, one used on this rank's features only is summed too (``sum_where_sharded``).
- A layer under Ulysses: weights unchanged; its attention modules exchange sequence for heads
  (:mod:`.attention`), and each rank's position embeddings are those of its slice.
- A layer with experts (the expert-parallel table names its experts module): the experts split over ep and etp
  and dispatched by all-to-all (:mod:`.experts`), whatever the attention's form; the block holding them (router,
  shared experts) routes distinct tokens on every rank (under plain tp, its ``1/tp`` of the sequence), and reports
  its router's statistics where the loss takes them over every layer (:mod:`.router`). The tp table's entries inside
  that block are not applied.
- Embedding and head under vocabulary tp: the token table and ``lm_head`` (the table's head projection: BERT's
  decoder, an image classifier over its labels) split over the vocabulary (padded), the loss vocabulary-parallel;
  under vocabulary sp, this rank's slice of the positions. An embedding side without a vocabulary (pixels) or whose
  forward needs the whole input (BERT's token types) runs whole under Megatron-SP and splits its output; a head
  scoring one label per image gathers the sequence first (``ModuleForm.whole``).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed import ProcessGroup

from galva_hp.model import ParallelContext
from galva_hp.parallel.mappings import group_rank
from galva_models.tables.attention import AttentionForm
from galva_models.tables.experts import distinct_tokens, expert_paths, split_experts
from galva_models.tables.modules import ModuleForm, TableEmbedding, TableHead, TableLayer
from galva_models.tables.plans import ModelTables
from galva_models.tables.router import watch_routers
from galva_models.tables.sharding import (
    TpRegion,
    enter_region_at,
    shard_linear,
    split_embedding,
    split_per_head,
    split_vocab_rows,
    sum_where_sharded,
)

__all__ = ["TableParallelizer", "attention_paths", "head_counts", "is_attention", "layer_config"]


def layer_config(config: Any, layer: int = 0) -> Any:
    """The config layer ``layer`` is built from: a heterogeneous config's per-layer view (whose global head
    counts cannot be read: they vary by layer), else ``config`` itself."""
    return config.per_layer_config[layer] if getattr(config, "is_heterogeneous", False) else config


def head_counts(config: Any, layer: int = 0) -> tuple[int, int, int]:
    """``(heads, key/value heads, head size)`` of layer ``layer`` of a config."""
    config = layer_config(config, layer)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv, head_dim


def is_attention(path: str) -> bool:
    return "attn" in path.lower() or "attention" in path.lower()


def attention_paths(tables: ModelTables) -> list[str]:
    """The attention modules of a layer (paths in it), as its tp table names them: where a form is attached."""
    return sorted({p.rsplit(".", 1)[0] for p in tables.tp if "." in p and is_attention(p)})


def _split_names(module: nn.Module) -> set[str]:
    return {n for n, p in module.named_parameters() if getattr(p, "galva_split", None) is not None}


class TableParallelizer:
    """In-place parallel forms of :class:`~.modules.TableEmbedding`, :class:`~.modules.TableLayer` and
    :class:`~.modules.TableHead` (each converted once: the module itself is returned)."""

    def __init__(
        self, config: Any, tables: ModelTables, router: tuple[type[nn.Module], int] | None = None, top_k: int = 0
    ) -> None:
        """``router``: the router class and the index of its logits, where the loss takes their statistics over
        every layer; ``top_k``: experts per token."""
        self.config, self.tables, self.router, self.top_k = config, tables, router, top_k

    def _experts(self, module: TableLayer, ctx: ParallelContext) -> str | None:
        """Put the layer's experts (if it has any) in their layout; returns the path of the block holding them."""
        paths = [p for p in expert_paths(self.tables.ep) if _find(module.layer, p) is not None]
        if not paths:
            return None
        path = paths[0]
        block_path = path.rpartition(".")[0]
        experts = module.layer.get_submodule(path)
        if ctx.ep_group is not None or ctx.etp_group is not None:
            split_experts(experts, path, ctx.ep_group, ctx.etp_group)
        for param in experts.parameters(recurse=False):
            param.galva_expert = True  # type: ignore[attr-defined]
        block = module.layer.get_submodule(block_path) if block_path else module.layer
        if ctx.ledger is not None and self.router is not None:
            watch_routers(block, self.router, ctx.ledger, f"layer{module.index}", self.top_k)
        return block_path

    def _heads(self, index: int) -> tuple[int, int, int]:
        """``(heads, key/value heads, head size)`` of layer ``index`` (from the table's hook where layers differ)."""
        if self.tables.layer_shapes is None:
            return head_counts(self.config, index)
        shape = self.tables.layer_shapes(self.config)[index]
        return shape.heads, shape.heads, shape.hidden // shape.heads

    def layer(self, module: nn.Module, layer_type: str, ctx: ParallelContext) -> nn.Module:
        assert isinstance(module, TableLayer)
        moe = self._experts(module, ctx)
        if ctx.tp_size == 1 and ctx.sp_size == 1 and ctx.cp_size == 1:
            return module
        own_sp = self.tables.sequence_parallel
        if self.tables.layer_shapes is not None and (
            ctx.sp_size > 1 or ctx.cp_size > 1 or (ctx.seq_sharded and own_sp is None)
        ):  # the constraints refuse this (:func:`.adapter.constraints`); a layer given a slice would fail later
            raise ValueError(f"{self.config.model_type}: {layer_type} layers run on the whole grid, not a slice")
        _once(module)
        tp_table = {p: st for p, st in self.tables.tp.items() if moe is None or not p.startswith(moe + ".")}
        attention = attention_paths(self.tables)
        if ctx.cp_size > 1 and not attention:  # the constraints refuse this; a ring left out would be silent
            raise ValueError(f"{self.config.model_type}: no attention module in its tp table to run the ring in")
        if ctx.tp_size == 1:  # Ulysses and / or context parallelism: weights whole
            # a table naming no attention module (DeepSeek's latent attention): the layer's own attention children
            named = attention or [n for n, c in module.layer.named_children() if type(c).__name__.endswith("Attention")]
            for path in named:
                sub = _find(module.layer, path)  # a hybrid's table names the attention of its other layers too
                if sub is not None:
                    sub.galva_attention = AttentionForm(  # type: ignore[assignment]
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
        heads, kv, head_dim = self._heads(module.index)
        replicate_kv = kv < heads and tp > kv
        summed: set[str] = set()
        replicated_kv = False  # key/value projections kept whole: each rank reads its heads in attention
        # a block enters the tp region where this layer has one of its column-parallel modules: a hybrid's table
        # names its other layers' modules too, and a whole block entered would have its input gradient summed twice
        here = {p: st for p, st in tp_table.items() if _find(module.layer, p) is not None}
        colwise = [p for p, st in here.items() if "colwise" in st and "." in p]
        entries = {p.rsplit(".", 1)[0] for p in colwise}
        # a family's own Megatron-SP (Swin's windows): the blocks it handles gather elsewhere and reduce later
        handled = own_sp(module, region) if sequence_parallel and own_sp is not None else frozenset()
        for path in sorted(entries - handled):
            block = _find(module.layer, path)
            if block is not None:
                enter_region_at(block, region)
        for path, style in tp_table.items():
            sub = _find(module.layer, path)
            if sub is None:  # an optional module this config does not build (e.g. a bias-free norm)
                continue
            prefix = f"layer.{path}."
            if style == "replicated_with_grad_allreduce":
                summed |= {prefix + n for n, _ in sub.named_parameters()}
                continue
            if style == "per_head":
                split_per_head(sub, group, path)
                continue
            is_kv = is_attention(path) and isinstance(sub, nn.Linear) and sub.out_features == kv * head_dim
            keep = replicate_kv and is_kv and style == "colwise"
            replicated_kv |= keep
            blocks = self.tables.blocks.get(path, 2)
            partial = any(path.startswith(block + ".") for block in handled)
            summed |= {
                prefix + n
                for n in shard_linear(sub, style, region, path, replicate=keep, blocks=blocks, partial=partial)
            }
        for attribute in self.tables.per_rank:  # features counted per rank (a packed projection's split size)
            owner_path, _, name = attribute.rpartition(".")
            owner = _find(module.layer, owner_path) if owner_path else module.layer
            if owner is not None:
                setattr(owner, name, getattr(owner, name) // tp)
        for path in attention:
            # heads are this rank's only where the block's projections stay split (not gathered back: Phi-3, Olmo 2)
            styles = [st for p, st in tp_table.items() if p.startswith(path + ".")]
            heads_split = any(st in ("colwise", "packed_colwise") for st in styles)
            sub = _find(module.layer, path)
            if sub is None or (not heads_split and ctx.cp_size == 1):
                continue
            first = (rank * (heads // tp)) // (heads // kv)
            sub.galva_attention = AttentionForm(  # type: ignore[assignment]
                kv_heads=(first, 1) if replicated_kv and heads_split else None,
                heads_group=group if heads_split else None,
                cp_group=ctx.cp_group,
                cp_index=ctx.cp_index,
            )
        for path in sorted(entries):
            block = _find(module.layer, path)
            if block is not None:
                inner = {p[len(path) + 1 :]: st for p, st in tp_table.items() if p.startswith(path + ".")}
                sum_where_sharded(block, {p: st for p, st in inner.items() if _find(block, p) is not None}, group)
        if moe is not None and not sequence_parallel:  # the block's router and shared experts see 1/tp of the tokens
            block = module.layer.get_submodule(moe) if moe else module.layer
            distinct_tokens(block, group)
            prefix = f"layer.{moe}." if moe else "layer."
            summed |= {prefix + n for n, p in block.named_parameters() if not getattr(p, "galva_expert", False)}
        if sequence_parallel:  # replicated parameters outside the blocks (norms, row-parallel biases) see a slice
            split = _split_names(module)
            inside = tuple(f"layer.{path}." for path in entries)
            biases = {f"layer.{p}.bias" for p, st in tp_table.items() if "rowwise" in st}
            summed |= {
                n
                for n, p in module.named_parameters()
                if n not in split
                and not getattr(p, "galva_expert", False)
                and (not n.startswith(inside) or n in biases)
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
            group, sequence_parallel = _tp_form(module, ctx)
            tp = ctx.tp_size
            table = self.tables.token_table
            # no vocabulary (pixels), or a forward that needs the whole input: whole, then this rank's slice
            whole = sequence_parallel and (table is None or self.tables.whole_embedding)
            if table is not None:
                split_embedding(module.get_submodule(table), group, sequence_parallel and not whole, table)
            sliced = sequence_parallel and not whole
            module.form = ModuleForm(
                grad_sums=_slice_sums(module, group) if sliced else _table_sums(module, table, group),
                seq_group=group if sequence_parallel else None,
                seq_shards=tp if sequence_parallel else 1,  # learned positions: this rank's slice (GPT-2's wpe)
                whole=whole,
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
            group, sequence_parallel = _tp_form(module, ctx)
            # one label per sample: the head gathers the sequence and runs whole (its labels are not sliced)
            per_sample = self.tables.task == "image_classification"
            region = TpRegion(group, sequence_parallel and not per_sample)
            config = self.config
            classes = config.num_labels if per_sample else config.get_text_config().vocab_size
            for _, path in self.tables.head:
                projection = module.get_submodule(path)
                split_vocab_rows(projection, ("weight", "bias"), group, classes)
                _follow_ties(module, path)
                enter_region_at(projection, region)
            module.form = ModuleForm(
                region=region,
                grad_sums=_slice_sums(module, group) if sequence_parallel and not per_sample else [],
                seq_group=group if sequence_parallel else None,
                vocab_group=group,
                whole=sequence_parallel and per_sample,
            )
        elif ctx.vocab_sp and ctx.sp_size > 1:
            _once(module)
            module.form = ModuleForm(seq_group=ctx.sp_group)
        return module


def _follow_ties(head: TableHead, path: str) -> None:
    """A parameter of the projection at ``path`` that the head also holds under another name (BERT's decoder bias is
    ``cls.predictions.bias``) is that split parameter under both names, so the tie holds. The names were taken when
    the head was cut (a module moved off the meta device has lost its ties)."""
    for alias, name in head.aliases.items():
        for one, other in ((alias, name), (name, alias)):
            if one.startswith(path + "."):
                owner, _, attribute = other.rpartition(".")
                head.get_submodule(owner)._parameters[attribute] = head.get_parameter(one)


def _table_sums(module: nn.Module, table: str | None, group: ProcessGroup) -> list[tuple[str, ProcessGroup]]:
    """Under vocabulary tp, a parameter the token table's own forward applies after its lookup (Inkling's
    ``embed_tokens.embed_norm``) sees only the rows this rank holds, the output being summed after that forward:
    its gradient is summed over tp."""
    if table is None:
        return []
    split = _split_names(module)
    return [(n, group) for n, _ in module.named_parameters() if n.startswith(table + ".") and n not in split]


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


def _tp_form(module: Any, ctx: ParallelContext) -> tuple[ProcessGroup, bool]:
    """Mark a vocabulary module as taking its tensor-parallel form now (once); its tp group and whether Megatron-SP
    slices its sequence."""
    _once(module)
    assert ctx.tp_group is not None
    return ctx.tp_group, ctx.sequence_parallel_tp


def _once(module: Any) -> None:
    if module.form is not None:
        raise ValueError(f"{type(module).__name__} is already in a parallel form (forms are applied in place, once)")
