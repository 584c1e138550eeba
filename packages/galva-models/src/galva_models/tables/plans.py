"""A model's parallel structure as tables: transformers' own (``base_model_tp_plan``, ``base_model_pp_plan``), or
Galva's, in the same format, for a family that has none (:data:`GALVA_TABLES`).

The pipeline table names the base model's modules in order: those before the repeated layers (the embedding side),
the layer list, and those after it (the final norm). The tensor-parallel table says, per module path inside one
layer (``self_attn.q_proj``), which form it takes (:data:`STYLES`). The expert-parallel table
(``base_model_ep_plan``) says, per module path inside one layer, which module holds the routed experts
(:mod:`.experts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from galva_models.tables import swin, t5
from galva_models.tables.hooks import LayerShape

__all__ = ["GALVA_TABLES", "STYLES", "ModelTables", "model_tables", "unsupported_styles"]

STYLES: dict[str, str] = {
    "colwise": "output features split over tp (input entered into the tp region)",
    "rowwise": "input features split over tp; output summed (or reduce-scattered along the sequence under "
    "Megatron-SP), bias added once",
    "colwise_gather_output": "colwise, output gathered back to every feature on every rank",
    "rowwise_split_input": "rowwise on this rank's part of a replicated input",
    "packed_colwise": "colwise on each of the packed blocks (a fused gate/up projection)",
    "packed_rowwise": "rowwise on each of the packed blocks",
    "replicated_with_grad_allreduce": "replicated; gradient summed over tp (it sees only this rank's heads)",
    "per_head": "a module whose parameters hold one column per attention head (Swin's relative-position table), "
    "split with the heads",
}
"""The tensor-parallel forms Galva runs in place, by transformers' style name."""

GALVA_TABLES: dict[str, dict[str, Any]] = {
    # GPT-2: Conv1D projections (weights stored [in, out]); q, k and v packed in one c_attn, which the attention
    # splits at ``split_size`` (the hidden size): a tp rank's c_attn holds a third of each, so split_size / tp
    "gpt2": {
        "tp": {
            "h.*.attn.c_attn": "packed_colwise",
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        "pp": {"wte": None, "wpe": None, "drop": None, "h": None, "ln_f": None},
        "layers": "h",
        "blocks": {"attn.c_attn": 3},
        "per_rank": ["attn.split_size"],
        "learned_positions": True,
    },
    # BERT, masked LM: post-LN layers under encoder.layer; attention.output and output add the residual and norm
    # after their row-parallel dense (on the boundary layout); the MLM head (transform, decoder tied to the word
    # table, decoder bias tied to cls.predictions.bias) is the task model's cls. Its embedding forward shapes token
    # types from the whole input, so under Megatron-SP it runs whole and its output is split after.
    "bert": {
        "tp": {
            "encoder.layer.*.attention.self.query": "colwise",
            "encoder.layer.*.attention.self.key": "colwise",
            "encoder.layer.*.attention.self.value": "colwise",
            "encoder.layer.*.attention.output.dense": "rowwise",
            "encoder.layer.*.intermediate.dense": "colwise",
            "encoder.layer.*.output.dense": "rowwise",
        },
        "pp": {"embeddings": None, "encoder.layer": None},
        "layers": "encoder.layer",
        "task": "masked_lm",
        "token_table": "embeddings.word_embeddings",
        "head": {"cls": "cls.predictions.decoder"},
        "whole_embedding": True,
        "learned_positions": True,
    },
    # ViT, image classification: pre-LN layers; pixels enter the embedding (patches, CLS token, positions: no
    # vocabulary); the classifier reads the CLS token after the final LayerNorm and splits over the labels
    "vit": {
        "tp": {
            "layers.*.attention.q_proj": "colwise",
            "layers.*.attention.k_proj": "colwise",
            "layers.*.attention.v_proj": "colwise",
            "layers.*.attention.o_proj": "rowwise",
            "layers.*.mlp.fc1": "colwise",
            "layers.*.mlp.fc2": "rowwise",
        },
        "pp": {"embeddings": None, "layers": None, "layernorm": None},
        "task": "image_classification",
        "inputs": "pixel_values",
        "token_table": None,
        "head": {"classifier": "classifier"},
        "whole_embedding": True,
        "tokens": lambda config: 1 + (config.image_size // config.patch_size) ** 2,
    },
    # Swin: stages of blocks, each stage's grid and width its own (hooks beside the entry, in its module)
    "swin": swin.TABLE,
    # T5: two stacks carried as one stream, a relative-position table per stack (its hook, in its module)
    "t5": t5.TABLE,
}
"""Galva's tables for families whose configs carry none, in transformers' format (``tp``: ``"<layers>.*.<path>"`` ->
style; ``pp``: the base model's modules in order), plus what transformers' format cannot say:

- ``layers``: the layer list's path in the base model (default ``layers``; dotted for a nested list);
- ``blocks``: how many packed blocks a ``packed_*`` module holds (2 by default);
- ``per_rank``: layer attributes that count features and are divided by the tp degree (a split size);
- ``learned_positions``: a position table bounds the sequence at ``max_position_embeddings``;
- ``task``: what the model learns (:class:`~galva_models.tables.family.Task` value; default ``causal_lm``);
- ``inputs``: the keyword the base model's forward takes its input by (default ``input_ids``; ``pixel_values``);
- ``token_table``: the vocabulary embedding's path in the base model, split over the vocabulary under vocab tp
  (default: the first pipeline entry; None: no vocabulary, the embedding side stays whole);
- ``head``: the task model's modules after the base model -> the path of the projection that splits over the
  vocabulary (or the labels) under vocab tp (default ``{"lm_head": "lm_head"}``);
- ``whole_embedding``: the embedding side runs on the whole sequence under Megatron-SP and its output is split
  after (its forward shapes per-position inputs from the whole input);
- ``tokens``: a hook, ``config -> sequence length``, for a family whose input fixes it (an image's patches);
- ``layers`` with a ``*`` (``encoder.layers.*.blocks``): a list of stages, each a list of layers, walked in order
  (:mod:`.hooks`); ``stage_end``: the module of each stage that runs after its last layer (patch merging);
- ``layer_shapes``: a hook, ``config -> one LayerShape per layer`` (:mod:`.hooks`), for a family whose layers differ
  by stage and are called with arguments the config fixes; ``tail``: a hook running the base model's forward after
  its layers, where the head reads more than the hidden state (Swin's pooler);
- ``facts``: what the commands read about the family where it is not the task's default (galva-train's size
  flags: per-stage sizes; T5's constraints and layer specs), as :class:`~galva_models.tables.family.FamilyAdapter`
  fields;
- ``sequence_parallel``: a hook putting one layer in Megatron-SP where its tokens are rearranged outside the
  attention function (Swin's window grid): where it gathers and reduce-scatters the sequence; it returns the blocks
  it handles (they do not enter the tp region, their row-parallel outputs stay partial sums for it to reduce);
- ``cut``: a hook cutting the model itself, ``(task model, the table path's parallelizer, **options) ->
  LayeredModel``, for a family whose layers do not take what its forward hands them (T5's two stacks: one stream,
  a shared position bias); its layers still take their tp form from ``tp`` in place.

A family with hooks keeps its entry and hooks in a module of its own (:mod:`.swin`, :mod:`.t5`)."""


@dataclass(frozen=True)
class ModelTables:
    """The tables of one model, resolved against its module tree."""

    source: str
    """``"transformers"`` (the config's own tables) or ``"galva"`` (:data:`GALVA_TABLES`)."""
    tp: dict[str, str]
    """Module path inside one layer -> tensor-parallel style."""
    before: tuple[str, ...]
    """Base-model modules before the layers (embedding side), in order."""
    layers: str
    """The base model's layer list."""
    after: tuple[str, ...]
    """Base-model modules after the layers (final norm)."""
    ep: dict[str, str]
    """Module path inside one layer -> expert-parallel style (empty without experts)."""
    blocks: dict[str, int]
    """Module path inside one layer -> packed blocks (a ``packed_*`` style; 2 where not given)."""
    per_rank: tuple[str, ...]
    """Layer attributes (``attn.split_size``) that count features: divided by the tp degree."""
    learned_positions: bool = False
    """A learned position table: no sequence longer than ``max_position_embeddings``."""
    task: str = "causal_lm"
    """What the model learns (a :class:`~galva_models.tables.family.Task` value)."""
    inputs: str = "input_ids"
    """The keyword the base model's forward takes the model input by."""
    token_table: str | None = None
    """The vocabulary embedding's path in the base model (None: the embedding side has no vocabulary)."""
    head: tuple[tuple[str, str], ...] = (("lm_head", "lm_head"),)
    """``(task-model module after the base model, path of the projection split over the vocabulary or labels)``."""
    whole_embedding: bool = False
    """Under Megatron-SP the embedding side runs on the whole sequence; its output is split after."""
    tokens: Callable[[Any], int] | None = None
    """``config -> sequence length`` where the input fixes it (images); None: the run's sequence length."""
    stage_end: str | None = None
    """The module of each stage (of a ``*`` layer path) run after the stage's last layer, on its arguments."""
    layer_shapes: Callable[[Any], list[LayerShape]] | None = None
    """``config -> one LayerShape per layer`` for a family whose layers differ by stage (:mod:`.hooks`)."""
    tail: Callable[[dict[str, nn.Module], Any], dict[str, Any]] | None = None
    """``(modules after the layers, hidden) -> base-model output fields``; None: the modules in turn."""
    facts: tuple[tuple[str, Any], ...] = ()
    """What the commands read about this family (:class:`~galva_models.tables.family.FamilyAdapter` fields)."""
    cut: Callable[..., Any] | None = None
    """``(task model, parallelizer, **options) -> LayeredModel``: the family's own cut (T5's); None: the table
    path's."""
    sequence_parallel: Callable[[nn.Module, Any], frozenset[str]] | None = None
    """``(layer, tp region) -> blocks it handles``: Megatron-SP of a family whose layers arrange their tokens outside
    the attention function (Swin's windows); None: the standard form, or none where ``layer_shapes`` is set."""

    @property
    def experts(self) -> bool:
        """The config has an expert-parallel table (a mixture of experts)."""
        return bool(self.ep)


def model_tables(config: Any, base: nn.Module | None = None) -> ModelTables | None:
    """The tables of ``config`` (None when it has neither transformers' nor Galva's). ``base``, the base model, is
    used to find which pipeline entry is the layer list (default: the entry named ``layers``)."""
    own = GALVA_TABLES.get(getattr(config, "model_type", ""))
    tp_plan = getattr(config, "base_model_tp_plan", None) or (own or {}).get("tp")
    pp_plan = getattr(config, "base_model_pp_plan", None) or (own or {}).get("pp")
    if not tp_plan or not pp_plan:
        return None
    names = list(pp_plan)
    layers = (own or {}).get("layers", "layers")
    if base is not None and "." not in layers:
        lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
        layers = lists[0] if len(lists) == 1 else layers
    if layers not in names:
        return None
    at = names.index(layers)
    prefix = f"{layers}.*."
    tp = {key[len(prefix) :]: style for key, style in tp_plan.items() if key.startswith(prefix)}
    extra = own or {}
    return ModelTables(
        source="galva" if own and not getattr(config, "base_model_tp_plan", None) else "transformers",
        tp=tp,
        before=tuple(names[:at]),
        layers=layers,
        after=tuple(names[at + 1 :]),
        ep={
            key[len(prefix) :]: style
            for key, style in (getattr(config, "base_model_ep_plan", None) or {}).items()
            if key.startswith(prefix)
        },
        blocks=dict(extra.get("blocks", {})),
        per_rank=tuple(extra.get("per_rank", ())),
        learned_positions=bool(extra.get("learned_positions", False)),
        task=str(extra.get("task", "causal_lm")),
        inputs=str(extra.get("inputs", "input_ids")),
        token_table=extra["token_table"] if "token_table" in extra else (names[0] if at else None),
        head=tuple(extra.get("head", {"lm_head": "lm_head"}).items()),
        whole_embedding=bool(extra.get("whole_embedding", False)),
        tokens=extra.get("tokens"),
        stage_end=extra.get("stage_end"),
        layer_shapes=extra.get("layer_shapes"),
        tail=extra.get("tail"),
        facts=tuple(extra.get("facts", {}).items()),
        sequence_parallel=extra.get("sequence_parallel"),
        cut=extra.get("cut"),
    )


def unsupported_styles(tables: ModelTables) -> dict[str, str]:
    """Module path -> style, for the layer modules whose tensor-parallel style Galva does not run."""
    return {path: style for path, style in tables.tp.items() if style not in STYLES}
