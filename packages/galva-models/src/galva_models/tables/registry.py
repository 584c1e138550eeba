"""Which family a Hugging Face model is, for the commands: every causal LM whose config carries transformers'
tensor-parallel and pipeline tables, and every family with a Galva table entry (:data:`~.plans.GALVA_TABLES`: GPT-2,
BERT, T5, ViT, Swin), each run from its tables (:mod:`.adapter`)."""

from __future__ import annotations

from typing import Any

from galva_hp.model import LayeredModel
from galva_models.tables.adapter import adapter_for as table_adapter
from galva_models.tables.adapter import supports
from galva_models.tables.family import FamilyAdapter
from galva_models.tables.plans import GALVA_TABLES

__all__ = ["adapter_for", "build_layered", "family_names"]


def family_names() -> list[str]:
    """The ``model_type`` values of Galva's table entries (every causal LM with tables is supported besides)."""
    return sorted(GALVA_TABLES)


def adapter_for(config_or_type: Any) -> FamilyAdapter:
    """What the commands read about a config's (or a ``model_type`` string's) model; a clear error says what is
    supported."""
    model_type = config_or_type if isinstance(config_or_type, str) else getattr(config_or_type, "model_type", None)
    config = config_or_type
    if isinstance(config_or_type, str):
        from transformers import CONFIG_MAPPING

        config = CONFIG_MAPPING[model_type]() if isinstance(model_type, str) and model_type in CONFIG_MAPPING else None
    if config is not None and supports(config):
        return table_adapter(config)
    raise ValueError(
        f"model_type {model_type!r} has no Galva adapter: supported are {', '.join(family_names())} and every "
        "causal LM whose config carries transformers' tensor-parallel and pipeline tables"
    )


def build_layered(config: Any, attn_implementation: str = "sdpa", **options: Any) -> tuple[Any, LayeredModel]:
    """Build the Hugging Face model for ``config`` and its LayeredModel (which holds its modules); ``options`` go to
    its cut (T5: ``encoder_seq_length``)."""
    adapter = adapter_for(config)
    model = adapter.build_model(config, attn_implementation=attn_implementation)
    return model, adapter.decompose(model, **options)
