"""One adapter per task for every family whose tables say how it splits (transformers' own, or Galva's): no family
code. Causal LMs (:data:`ADAPTER`), and the encoder families of :data:`~.plans.GALVA_TABLES` (BERT's masked LM,
ViT's image classification: :func:`adapter_for`). The model is cut where it stands (:mod:`.modules`), parallelized
in place from its tables (:mod:`.parallel`), and its attention runs through Galva's registered functions
(:mod:`.attention`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from galva_hp.model import LayeredModel
from galva_models.adapters.base import FamilyAdapter, LayerSpec, Task, tie_and_check
from galva_models.tables.attention import PREFIX, galva_implementation
from galva_models.tables.modules import LayerInputs, TableEmbedding, TableHead, TableLayer, materialized_copy
from galva_models.tables.parallel import TableParallelizer, head_counts
from galva_models.tables.plans import ModelTables, model_tables, unsupported_styles
from galva_schema import LayerTypeConstraints, ModelConstraints, ParallelForm
from galva_schema.constraints import uniform_constraints

__all__ = ["ADAPTER", "ADAPTERS", "adapter_for", "supports"]


_AUTO_CLASSES = {
    Task.CAUSAL_LM: "AutoModelForCausalLM",
    Task.MASKED_LM: "AutoModelForMaskedLM",
    Task.IMAGE_CLASSIFICATION: "AutoModelForImageClassification",
}


def supports(config: Any) -> bool:
    """Whether ``config`` is a model whose tables this package can cut: a causal LM with tables, or a family with a
    Galva table entry for its task."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tables = model_tables(config)
    if tables is None:
        return False
    causal = tables.task == Task.CAUSAL_LM.value
    if causal and getattr(config, "model_type", None) not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False
    return getattr(config, "num_attention_heads", None) is not None and getattr(config, "hidden_size", None) is not None


def adapter_for(config: Any) -> FamilyAdapter:
    """The table adapter of ``config``'s task (call :func:`supports` first)."""
    return ADAPTERS[Task(_tables(config).task)]


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    """The task model; a family that cannot run SDPA (soft-capped attention logits) runs its own eager attention."""
    import transformers

    auto = getattr(transformers, _AUTO_CLASSES[Task(_tables(config).task)])
    try:
        return auto.from_config(config, attn_implementation=attn_implementation)
    except ValueError:
        if attn_implementation != "sdpa":
            raise
        return auto.from_config(config, attn_implementation="eager")


def _tables(config: Any, base: nn.Module | None = None) -> ModelTables:
    tables = model_tables(config, base)
    if tables is None:
        raise ValueError(f"{config.model_type}: no tensor-parallel and pipeline tables")
    return tables


def decompose(model: Any) -> LayeredModel:
    """A task model -> LayeredModel holding its own modules; attention switched to Galva's registered form of the
    model's implementation (the same computation until a parallel form is attached)."""
    config = model.config
    base = model.base_model
    tables = _tables(config, base)
    current = config._attn_implementation
    if not str(current).startswith(PREFIX):
        config._attn_implementation = galva_implementation(current)
    named = {tables.layers.partition(".")[0], *tables.before, *tables.after}
    context = {
        name: child
        for name, child in base.named_children()
        if name not in named and next(child.parameters(), None) is None
    }

    def inputs() -> LayerInputs:
        copies = {n: materialized_copy(m, model) for n, m in context.items()}
        return LayerInputs(base, tables.layers, copies, tables.before, tables.inputs)

    stack = base.get_submodule(tables.layers)
    layers: list[nn.Module] = [TableLayer(layer, i, inputs()) for i, layer in enumerate(stack)]
    family = config.model_type
    head = {name: model.get_submodule(name) for name, _ in tables.head}
    layered = LayeredModel(
        embedding=TableEmbedding({n: getattr(base, n) for n in tables.before}, inputs(), tables.inputs),
        layers=layers,
        head=TableHead(
            {n: getattr(base, n) for n in tables.after}, head, model, model.base_model_prefix, tables.inputs
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
    longest = config.max_position_embeddings if tables.learned_positions else None
    if tables.tokens is not None:  # the input fixes the sequence: every layer's boundary holds its tokens
        layer_type = LayerTypeConstraints(
            name=config.model_type, num_layers=config.num_hidden_layers, num_heads=heads, num_kv_heads=kv,
            unsupported=unsupported, seq_length=tables.tokens(config),
        )  # fmt: skip
        return ModelConstraints(
            model_name=config.model_type, layer_types=(layer_type,), vocab_unsupported=_per_sample(config.model_type)
        )
    return uniform_constraints(
        config.model_type, config.model_type, config.num_hidden_layers, heads, kv,
        unsupported=unsupported, max_seq_length=longest,
    )  # fmt: skip


def _per_sample(family: str) -> dict[ParallelForm, str]:
    """A head scoring one label per image runs vocab tp (its classifier split over the labels), not vocab sp."""
    reason = f"{family} scores one label per image, not per token: there is no sequence to split; use vocab sp off"
    return {ParallelForm.VOCAB_SP: reason}


def layer_specs(config: Any, seq_length: int) -> list[LayerSpec]:
    """One spec per layer; ``seq_length`` is ignored where the input fixes the sequence (images)."""
    tokens = _tables(config).tokens
    seq = tokens(config) if tokens is not None else seq_length
    return [LayerSpec(config.model_type, seq, config.hidden_size)] * config.num_hidden_layers


def set_num_layers(config: Any, num_layers: int) -> None:
    """Change the layer count; a per-layer type list (sliding / full attention) keeps its repeating pattern."""
    types = getattr(config, "layer_types", None)
    config.num_hidden_layers = num_layers
    if types:
        config.layer_types = [types[i % len(types)] for i in range(num_layers)]


def _adapter(task: Task) -> FamilyAdapter:
    return FamilyAdapter(
        name="tables", model_types=(), task=task,
        build_model=build_model, decompose=decompose, constraints=constraints, layer_specs=layer_specs,
        set_num_layers=set_num_layers, ffn_size_field="intermediate_size",
        kv_heads_field="num_key_value_heads" if task is Task.CAUSAL_LM else None,
    )  # fmt: skip


ADAPTERS: dict[Task, FamilyAdapter] = {task: _adapter(task) for task in _AUTO_CLASSES}
"""The table adapter of each task a table can name."""
ADAPTER = ADAPTERS[Task.CAUSAL_LM]
