"""Which adapter handles a Hugging Face model: a family adapter for the families without tables (``_MODULES``),
otherwise the table adapter of its task (:mod:`galva_models.tables`) for any causal LM whose tables say how it
splits and any family with a Galva table entry (GPT-2, BERT, ViT, Swin)."""

from __future__ import annotations

import importlib
from typing import Any

from galva_hp.model import LayeredModel
from galva_models.adapters.base import FamilyAdapter

_MODULES: tuple[str, ...] = ()
"""Adapter modules under galva_models.adapters, each exposing ``ADAPTER``."""


def _adapters() -> list[FamilyAdapter]:
    return [importlib.import_module(f"galva_models.adapters.{name}").ADAPTER for name in _MODULES]


def family_names() -> list[str]:
    """The ``model_type`` values of the family adapters and of Galva's table entries (every causal LM with tables is
    supported besides)."""
    from galva_models.tables import GALVA_TABLES

    return sorted({*(t for a in _adapters() for t in a.model_types), *GALVA_TABLES})


def adapter_for(config_or_type: Any) -> FamilyAdapter:
    """The adapter for a config (or a ``model_type`` string); a clear error says what is supported."""
    from galva_models import tables

    model_type = config_or_type if isinstance(config_or_type, str) else getattr(config_or_type, "model_type", None)
    for adapter in _adapters():
        if model_type in adapter.model_types:
            return adapter
    config = config_or_type
    if isinstance(config_or_type, str):
        from transformers import CONFIG_MAPPING

        config = CONFIG_MAPPING[model_type]() if isinstance(model_type, str) and model_type in CONFIG_MAPPING else None
    if config is not None and tables.supports(config):
        return tables.adapter_for(config)
    raise ValueError(
        f"model_type {model_type!r} has no Galva adapter: supported are {', '.join(family_names())} and every "
        "causal LM whose config carries transformers' tensor-parallel and pipeline tables"
    )


def build_layered(config: Any, attn_implementation: str = "sdpa", **options: Any) -> tuple[Any, LayeredModel]:
    """Build the Hugging Face model for ``config`` and its LayeredModel (which shares its modules)."""
    adapter = adapter_for(config)
    model = adapter.build_model(config, attn_implementation=attn_implementation)
    return model, adapter.decompose(model, **options)
