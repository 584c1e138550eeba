"""One adapter per task for every family whose tables say how it splits (transformers' own, or Galva's): no family
code. Causal LMs (:data:`ADAPTER`), and the encoder families of :data:`~.plans.GALVA_TABLES` (BERT's masked LM,
ViT's and Swin's image classification: :func:`adapter_for`). The model is cut where it stands (:mod:`.modules`),
parallelized in place from its tables (:mod:`.parallel`), and its attention runs through Galva's registered
functions (:mod:`.attention`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from galva_hp.model import LayeredModel
from galva_models.tables.attention import PREFIX, galva_implementation
from galva_models.tables.experts import expert_paths
from galva_models.tables.family import FamilyAdapter, LayerSpec, Task, tie_and_check
from galva_models.tables.hooks import LayerShape, layer_lists
from galva_models.tables.mixing import hidden_mixers
from galva_models.tables.modules import LayerInputs, TableEmbedding, TableHead, TableLayer, materialized_copy
from galva_models.tables.parallel import TableParallelizer, attention_paths, head_counts, is_attention, layer_config
from galva_models.tables.plans import ModelTables, model_tables, unsupported_styles
from galva_models.tables.router import router_class, router_loss
from galva_models.tiny_layers import per_layer_lists
from galva_schema import LayerTypeConstraints, ModelConstraints, ParallelForm

__all__ = ["ADAPTER", "ADAPTERS", "adapter_for", "supports"]


_AUTO_CLASSES = {
    Task.CAUSAL_LM: "AutoModelForCausalLM",
    Task.MASKED_LM: "AutoModelForMaskedLM",
    Task.SEQ2SEQ_LM: "AutoModelForSeq2SeqLM",
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
    heads = getattr(layer_config(config), "num_attention_heads", None)
    return heads is not None and getattr(config, "hidden_size", None) is not None


def adapter_for(config: Any) -> FamilyAdapter:
    """The table adapter of ``config``'s task (call :func:`supports` first), with the facts its table gives."""
    tables = _tables(config)
    adapter = ADAPTERS[Task(tables.task)]
    return dataclasses.replace(adapter, **dict(tables.facts)) if tables.facts else adapter


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


def decompose(model: Any, **options: Any) -> LayeredModel:
    """A task model -> LayeredModel holding its own modules; attention switched to Galva's registered form of the
    model's implementation (the same computation until a parallel form is attached). ``options`` go to the table's
    own cut (T5's boundary: ``encoder_seq_length``); the table path's takes none."""
    config = model.config
    base = model.base_model
    tables = _tables(config, base)
    current = config._attn_implementation
    if not str(current).startswith(PREFIX):
        config._attn_implementation = galva_implementation(current)
    if tables.cut is not None:
        return tie_and_check(model, tables.cut(model, TableParallelizer(config, tables), **options))
    if options:
        raise ValueError(f"{config.model_type}: decompose takes no options ({', '.join(sorted(options))})")
    named = {tables.layers.partition(".")[0], *tables.before, *tables.after}
    context = {
        name: child
        for name, child in base.named_children()
        if name not in named and next(child.parameters(), None) is None
    }

    shapes = tables.layer_shapes(config) if tables.layer_shapes is not None else None
    calls = None if shapes is None else [(s.args, s.kwargs) for s in shapes]

    def inputs() -> LayerInputs:
        copies = {n: materialized_copy(m, model) for n, m in context.items()}
        return LayerInputs(base, tables.layers, copies, tables.before, tables.inputs, calls)

    layers: list[nn.Module] = []
    end_name = tables.stage_end
    for path, stack in layer_lists(base, tables.layers):
        end = getattr(base.get_submodule(path.rpartition(".")[0]), end_name) if end_name else None
        for j, layer in enumerate(stack):  # a stage's own module after its last layer (None: the last stage's)
            last = (end_name, end) if end_name and end is not None and j == len(stack) - 1 else None
            layers.append(TableLayer(layer, len(layers), inputs(), last))
    family = config.model_type
    head = {name: model.get_submodule(name) for name, _ in tables.head}
    balance = router_loss(model)
    router = router_class(base) if balance is not None else None
    model_constraints = constraints(config)
    after = {n: getattr(base, n) for n in tables.after}
    layered = LayeredModel(
        embedding=TableEmbedding({n: getattr(base, n) for n in tables.before}, inputs(), tables.inputs),
        layers=layers,
        head=TableHead(after, head, model, model.base_model_prefix, tables.inputs, tables.tail),
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
    unsupported: dict[ParallelForm, str] = {}
    # None: the probe could not build it (it runs one layer list, not stages), every entry counts
    built = hidden_mixers(config, tables.layers) if tables.layer_shapes is None else None
    odd = {
        p: st
        for p, st in unsupported_styles(tables).items()
        if not _inside_experts(p, tables) and (built is None or p in built.paths)
    }
    if odd:
        path, style = next(iter(odd.items()))
        reason = f"{config.model_type}'s tp table gives {path} the style {style!r}, which Galva does not run"
        unsupported[ParallelForm.TP] = reason
        unsupported[ParallelForm.MEGATRON_SP] = reason
    ring = ring_refusal(config)
    if not ring and not attention_paths(tables):
        ring = f"{config.model_type}'s tp table names no attention module for the ring to run in"
    if ring:
        unsupported[ParallelForm.CP] = ring
    if not any(is_attention(p) for p in tables.tp):  # its tp leaves attention whole, on the whole sequence
        unsupported[ParallelForm.MEGATRON_SP] = (
            f"{config.model_type}'s tp table splits no attention module, which would see a sequence slice"
        )
    longest = config.max_position_embeddings if tables.learned_positions else None
    if tables.layer_shapes is not None:
        return _staged(config, tables, unsupported)
    heads, kv, _ = head_counts(config)
    if tables.tokens is not None:  # the input fixes the sequence: every layer's boundary holds its tokens
        layer_type = LayerTypeConstraints(
            name=config.model_type, num_layers=config.num_hidden_layers, num_heads=heads, num_kv_heads=kv,
            unsupported=unsupported, seq_length=tables.tokens(config),
        )  # fmt: skip
        return ModelConstraints(
            model_name=config.model_type, layer_types=(layer_type,), vocab_unsupported=_per_sample(config.model_type)
        )
    experts = _expert_layers(config.to_json_string()) if tables.experts else [None] * config.num_hidden_layers
    mixing = _mixing_refusals(config, tables)
    heads_per_layer = [head_counts(config, i)[:2] for i in range(config.num_hidden_layers)]
    runs: list[tuple[tuple[tuple[int, int] | None, str, tuple[int, int]], int]] = []
    for kind in zip(experts, mixing, heads_per_layer, strict=True):
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1] + 1)
        else:
            runs.append((kind, 1))
    family = config.model_type
    made = ModelConstraints(
        model_name=family,
        layer_types=tuple(
            LayerTypeConstraints(
                name=family if expert is not None or not tables.experts else f"{family}_dense",
                num_layers=count,
                num_heads=layer_heads[0],
                num_kv_heads=layer_heads[1],
                unsupported={**unsupported, **dict.fromkeys(_SEQUENCE_FORMS, mixes)} if mixes else unsupported,
                num_experts=expert[0] if expert else 0,
                expert_ffn=expert[1] if expert else None,
            )
            for (expert, mixes, layer_heads), count in runs
        ),
        max_seq_length=longest,
        context_parallel=True,
    )
    if ring:
        made = made.model_copy(update={"vocab_unsupported": {**made.vocab_unsupported, ParallelForm.CP: ring}})
    return made


_SEQUENCE_FORMS = (ParallelForm.ULYSSES, ParallelForm.MEGATRON_SP, ParallelForm.CP)
"""The forms that give a layer a slice of the sequence, whole only inside the registered attention function."""


def _staged(config: Any, tables: ModelTables, unsupported: dict[ParallelForm, str]) -> ModelConstraints:
    """Constraints of a family whose layers differ by stage (:mod:`.hooks`): one layer type per run of equal
    shapes, with its heads and tokens (and a stage end's merged tokens, which a sequence split must divide too).
    Its layers take a fixed grid from the base forward (windows, patch merging: token mixing outside the attention
    function), so the sequence forms, which would hand them a slice, are refused; Megatron-SP runs where the table
    has a hook gathering the grid around the windows (``sequence_parallel``: Swin's)."""
    family = config.model_type
    shapes = tables.layer_shapes(config) if tables.layer_shapes is not None else []
    refused = tuple(f for f in _SEQUENCE_FORMS if f is not ParallelForm.MEGATRON_SP or tables.sequence_parallel is None)
    stages: dict[str, list[LayerShape]] = {}
    for shape in shapes:  # a stage's layers are consecutive
        stages.setdefault(shape.layer_type, []).append(shape)
    types = []
    for name, stage in stages.items():
        first = stage[0]
        reason = (
            f"{family}'s layers arrange their {first.tokens} tokens as a grid of windows outside the attention "
            "function (window partition and shift, patch merging), which a sequence split would cut"
        )
        types.append(
            LayerTypeConstraints(
                name=name, num_layers=len(stage), num_heads=first.heads,
                unsupported={**unsupported, **dict.fromkeys(refused, reason)},
                seq_length=first.tokens, output_seq_length=stage[-1].output_tokens,
            )
        )  # fmt: skip
    return ModelConstraints(model_name=family, layer_types=tuple(types), vocab_unsupported=_per_sample(family))


def _mixing_refusals(config: Any, tables: ModelTables) -> list[str]:
    """Per layer, why the sequence forms cannot run it ("" where they can): it mixes tokens outside the registered
    attention (:mod:`.mixing`), e.g. a linear-attention or state-space layer, which would see a slice only."""
    found = hidden_mixers(config, tables.layers)
    if found is None or not any(found.layers):
        return [""] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    where = f" ({', '.join(found.modules)})" if found.modules else ""
    return [
        f"{config.model_type}'s {kind or 'token-mixing'} layers read other tokens outside the attention function"
        f"{where} (a recurrence, a convolution, a selection of keys or a mask from activations), which a sequence "
        "split would cut"
        if mixes
        else ""
        for kind, mixes in zip(types, found.layers, strict=True)
    ]


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


def _per_sample(family: str) -> dict[ParallelForm, str]:
    """A head scoring one label per image runs vocab tp (its classifier split over the labels), not vocab sp."""
    reason = f"{family} scores one label per image, not per token: there is no sequence to split; use vocab sp off"
    return {ParallelForm.VOCAB_SP: reason}


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
    """One spec per layer, named by its type (dense and expert layers differ); ``seq_length`` is ignored where the
    input fixes the sequence (images)."""
    tables = _tables(config)
    if tables.layer_shapes is not None:
        return [LayerSpec(s.layer_type, s.tokens, s.hidden) for s in tables.layer_shapes(config)]
    tokens = tables.tokens
    seq = tokens(config) if tokens is not None else seq_length
    types = [t.name for t in constraints(config).layer_types for _ in range(t.num_layers)]
    return [LayerSpec(name, seq, config.hidden_size) for name in types]


def set_num_layers(config: Any, num_layers: int) -> None:
    """Change the layer count; every per-layer list (attention and MLP kinds, per-layer sizes) keeps its repeating
    pattern."""
    lists = per_layer_lists(config)
    config.num_hidden_layers = num_layers
    for field, values in lists.items():
        setattr(config, field, [values[i % len(values)] for i in range(num_layers)])


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
