"""A model's parallel structure as tables: transformers' own (``base_model_tp_plan``, ``base_model_pp_plan``), or
Galva's, in the same format, for a family that has none (:data:`GALVA_TABLES`).

The pipeline table names the base model's modules in order: those before the repeated layers (the embedding side),
the layer list, and those after it (the final norm). The tensor-parallel table says, per module path inside one
layer (``self_attn.q_proj``), which form it takes (:data:`STYLES`). The expert-parallel table
(``base_model_ep_plan``) says, per module path inside one layer, which module holds the routed experts
(:mod:`.experts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

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
}
"""Galva's tables for families whose configs carry none, in transformers' format (``tp``: ``"<layers>.*.<path>"`` ->
style; ``pp``: the base model's modules in order), plus what transformers' format cannot say: ``layers`` (the layer
list's name), ``blocks`` (how many packed blocks a ``packed_*`` module holds, 2 by default), ``per_rank`` (layer
attributes that count features and are divided by the tp degree, e.g. a split size), ``learned_positions`` (a
position table bounds the sequence at ``max_position_embeddings``). BERT, T5, ViT and Swin keep
their adapters (:mod:`galva_models.adapters`) until they move here."""


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
    if base is not None:
        lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
        layers = lists[0] if len(lists) == 1 else layers
    if layers not in names:
        return None
    at = names.index(layers)
    prefix = f"{layers}.*."
    tp = {key[len(prefix) :]: style for key, style in tp_plan.items() if key.startswith(prefix)}
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
        blocks=dict((own or {}).get("blocks", {})),
        per_rank=tuple((own or {}).get("per_rank", ())),
        learned_positions=bool((own or {}).get("learned_positions", False)),
    )


def unsupported_styles(tables: ModelTables) -> dict[str, str]:
    """Module path -> style, for the layer modules whose tensor-parallel style Galva does not run."""
    return {path: style for path, style in tables.tp.items() if style not in STYLES}
