"""One adapter for every causal-LM family whose tables say how it splits (transformers' own, or Galva's):
no family code. The model is cut where it stands (:mod:`.modules`), parallelized in place from its tables
(:mod:`.parallel`), and its attention runs through Galva's registered functions (:mod:`.attention`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from galva_hp.model import LayeredModel
from galva_models.adapters.base import FamilyAdapter, LayerSpec, Task, tie_and_check
from galva_models.tables.attention import PREFIX, galva_implementation
from galva_models.tables.experts import expert_paths
from galva_models.tables.modules import LayerInputs, TableEmbedding, TableHead, TableLayer, materialized_copy
from galva_models.tables.parallel import TableParallelizer, head_counts, is_attention
from galva_models.tables.plans import ModelTables, model_tables, unsupported_styles
from galva_models.tables.router import router_class, router_loss
from galva_schema import LayerTypeConstraints, ModelConstraints, ParallelForm

__all__ = ["ADAPTER", "supports"]


def supports(config: Any) -> bool:
    """Whether ``config`` is a causal LM whose tables this adapter can cut."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "model_type", None) not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False
    if getattr(config, "num_attention_heads", None) is None or getattr(config, "hidden_size", None) is None:
        return False
    return model_tables(config) is not None


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    """The task model; a family that cannot run SDPA (soft-capped attention logits) runs its own eager attention."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    except ValueError:
        if attn_implementation != "sdpa":
            raise
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _tables(config: Any, base: nn.Module | None = None) -> ModelTables:
    tables = model_tables(config, base)
    if tables is None:
        raise ValueError(f"{config.model_type}: no tensor-parallel and pipeline tables")
    return tables


def decompose(model: Any) -> LayeredModel:
    """A causal LM -> LayeredModel holding its own modules; attention switched to Galva's registered form of the
    model's implementation (the same computation until a parallel form is attached)."""
    config = model.config
    base = model.base_model
    tables = _tables(config, base)
    current = config._attn_implementation
    if not str(current).startswith(PREFIX):
        config._attn_implementation = galva_implementation(current)
    named = {tables.layers, *tables.before, *tables.after}
    context = {
        name: child
        for name, child in base.named_children()
        if name not in named and next(child.parameters(), None) is None
    }

    def inputs() -> LayerInputs:
        copies = {n: materialized_copy(m, model) for n, m in context.items()}
        return LayerInputs(base, tables.layers, copies, tables.before)

    layers: list[nn.Module] = [TableLayer(layer, i, inputs()) for i, layer in enumerate(getattr(base, tables.layers))]
    family = config.model_type
    balance = router_loss(model)
    router = router_class(base) if balance is not None else None
    model_constraints = constraints(config)
    layered = LayeredModel(
        embedding=TableEmbedding({n: getattr(base, n) for n in tables.before}, inputs()),
        layers=layers,
        head=TableHead(
            {n: getattr(base, n) for n in tables.after}, model.get_output_embeddings(), model, model.base_model_prefix
        ),
        layer_types=[t.name for t in model_constraints.layer_types for _ in range(t.num_layers)],
        parallelizer=TableParallelizer(config, tables, router, int(getattr(model, "num_experts_per_tok", 0) or 0)),
        name=family,
        constraints=model_constraints,
        router_loss=balance,
    )
    return tie_and_check(model, layered)


def constraints(config: Any, seq_length: int | None = None, decoder_seq_length: int | None = None) -> ModelConstraints:
    """Heads and key/value heads from the config; tp refused where the table has a style Galva does not run. A
    mixture of experts states its experts and their FFN size per run of layers (dense layers, e.g. DeepSeek's first
    ones, are a type of their own: ``<family>_dense``)."""
    tables = _tables(config)
    heads, kv, _ = head_counts(config)
    unsupported: dict[ParallelForm, str] = {}
    odd = {p: st for p, st in unsupported_styles(tables).items() if not _inside_experts(p, tables)}
    if odd:
        path, style = next(iter(odd.items()))
        reason = f"{config.model_type}'s tp table gives {path} the style {style!r}, which Galva does not run"
        unsupported[ParallelForm.TP] = reason
        unsupported[ParallelForm.MEGATRON_SP] = reason
    if not any(is_attention(p) for p in tables.tp):  # its tp leaves attention whole, on the whole sequence
        unsupported[ParallelForm.MEGATRON_SP] = (
            f"{config.model_type}'s tp table splits no attention module, which would see a sequence slice"
        )
    longest = config.max_position_embeddings if tables.learned_positions else None
    kinds = _expert_layers(config.to_json_string()) if tables.experts else [None] * config.num_hidden_layers
    runs: list[tuple[tuple[int, int] | None, int]] = []
    for kind in kinds:
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1] + 1)
        else:
            runs.append((kind, 1))
    family = config.model_type
    return ModelConstraints(
        model_name=family,
        layer_types=tuple(
            LayerTypeConstraints(
                name=family if kind is not None or not tables.experts else f"{family}_dense",
                num_layers=count,
                num_heads=heads,
                num_kv_heads=kv,
                unsupported=unsupported,
                num_experts=kind[0] if kind else 0,
                expert_ffn=kind[1] if kind else None,
            )
            for kind, count in runs
        ),
        max_seq_length=longest,
    )


def _inside_experts(path: str, tables: ModelTables) -> bool:
    """A tp-table entry of the block holding the experts (its layout is the expert layout, not the tp table's)."""
    blocks = {p.rpartition(".")[0] for p in expert_paths(tables.ep)}
    return any(path.startswith(b + ".") for b in blocks)


@functools.lru_cache(maxsize=8)
def _expert_layers(config_json: str) -> list[tuple[int, int] | None]:
    """Per layer, ``(experts, expert FFN size)`` or None for a dense layer: read from the model built on the meta
    device (which layers have experts is the family's code: DeepSeek's first ones, Qwen's sparse step)."""
    import json

    from transformers import AutoConfig

    raw = json.loads(config_json)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        model = build_model(config)
    base: nn.Module = model.base_model  # type: ignore[assignment]
    tables = _tables(config, base)
    out: list[tuple[int, int] | None] = []
    for layer in getattr(base, tables.layers):
        found = None
        for path in expert_paths(tables.ep):
            try:
                experts = layer.get_submodule(path)
            except AttributeError:
                continue
            down = experts.get_parameter("down_proj")
            transposed = bool(getattr(experts, "is_transposed", False))
            found = (int(down.shape[0]), int(down.shape[1] if transposed else down.shape[2]))
        out.append(found)
    return out


def layer_specs(config: Any, seq_length: int) -> list[LayerSpec]:
    types = [t.name for t in constraints(config).layer_types for _ in range(t.num_layers)]
    return [LayerSpec(name, seq_length, config.hidden_size) for name in types]


def set_num_layers(config: Any, num_layers: int) -> None:
    """Change the layer count; a per-layer type list (sliding / full attention) keeps its repeating pattern."""
    types = getattr(config, "layer_types", None)
    config.num_hidden_layers = num_layers
    if types:
        config.layer_types = [types[i % len(types)] for i in range(num_layers)]


ADAPTER = FamilyAdapter(
    name="tables", model_types=(), task=Task.CAUSAL_LM,
    build_model=build_model, decompose=decompose, constraints=constraints, layer_specs=layer_specs,
    set_num_layers=set_num_layers, ffn_size_field="intermediate_size", kv_heads_field="num_key_value_heads",
)  # fmt: skip
