"""One adapter for every causal-LM family whose tables say how it splits (transformers' own, or Galva's):
no family code. The model is cut where it stands (:mod:`.modules`), parallelized in place from its tables
(:mod:`.parallel`), and its attention runs through Galva's registered functions (:mod:`.attention`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from galva_hp.model import LayeredModel
from galva_models.adapters.base import FamilyAdapter, LayerSpec, Task, tie_and_check
from galva_models.tables.attention import PREFIX, galva_implementation
from galva_models.tables.modules import LayerInputs, TableEmbedding, TableHead, TableLayer, materialized_copy
from galva_models.tables.parallel import TableParallelizer, attention_paths, head_counts
from galva_models.tables.plans import ModelTables, model_tables, unsupported_styles
from galva_schema import ModelConstraints, ParallelForm
from galva_schema.constraints import uniform_constraints

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
    layered = LayeredModel(
        embedding=TableEmbedding({n: getattr(base, n) for n in tables.before}, inputs()),
        layers=layers,
        head=TableHead(
            {n: getattr(base, n) for n in tables.after}, model.get_output_embeddings(), model, model.base_model_prefix
        ),
        layer_types=[family] * len(layers),
        parallelizer=TableParallelizer(config, tables),
        name=family,
        constraints=constraints(config),
    )
    return tie_and_check(model, layered)


def constraints(config: Any, seq_length: int | None = None, decoder_seq_length: int | None = None) -> ModelConstraints:
    """Heads and key/value heads from the config; tp refused where the table has a style Galva does not run (or
    experts, whose layout is its own)."""
    tables = _tables(config)
    heads, kv, _ = head_counts(config)
    unsupported: dict[ParallelForm, str] = {}
    odd = unsupported_styles(tables)
    if tables.experts:
        reason = f"{config.model_type} has expert layers; their tensor-parallel layout is not run yet"
    elif odd:
        path, style = next(iter(odd.items()))
        reason = f"{config.model_type}'s tp table gives {path} the style {style!r}, which Galva does not run"
    else:
        reason = ""
    if reason:
        unsupported[ParallelForm.TP] = reason
        unsupported[ParallelForm.MEGATRON_SP] = reason
    ring = ring_refusal(config)
    if not ring and not attention_paths(tables):
        ring = f"{config.model_type}'s tp table names no attention module for the ring to run in"
    if ring:
        unsupported[ParallelForm.CP] = ring
    longest = config.max_position_embeddings if tables.learned_positions else None
    made = uniform_constraints(
        config.model_type, config.model_type, config.num_hidden_layers, heads, kv,
        unsupported=unsupported, max_seq_length=longest, context_parallel=True,
    )  # fmt: skip
    if ring:
        made = made.model_copy(update={"vocab_unsupported": {**made.vocab_unsupported, ParallelForm.CP: ring}})
    return made


_SINKS = ("s_aux=", "sinks=")
"""How a family's attention call hands its sinks to the attention function."""


def ring_refusal(config: Any) -> str:
    """Why ring attention (plain scaled dot-product, :mod:`.attention`) would not compute this family's attention
    ("" when it would): soft-capped scores, attention sinks, attention dropout."""
    import inspect

    family = config.model_type
    if getattr(config, "attn_logit_softcapping", None):
        return f"{family}'s attention soft-caps its scores, which ring attention does not compute"
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return f"{family} drops attention probabilities out, which ring attention does not do"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        import transformers

        module = inspect.getmodule(getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]))
        source = inspect.getsource(module) if module is not None else ""
    except (AttributeError, KeyError, OSError, TypeError):
        source = ""
    if any(sink in source for sink in _SINKS):
        return f"{family}'s attention has sinks, which ring attention does not compute"
    return ""


def layer_specs(config: Any, seq_length: int) -> list[LayerSpec]:
    return [LayerSpec(config.model_type, seq_length, config.hidden_size)] * config.num_hidden_layers


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
