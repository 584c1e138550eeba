"""Which Hugging Face tensors make up each Galva module of a model, asked of galva-models.

The family knowledge (what is a layer, which names are tied) lives once, in galva-models' adapters; galva-ckpt
only consumes it through the small structural types below. galva-models is imported lazily and is the ``hf``
extra of this distribution, so that galva-models (galva-train) can itself depend on galva-ckpt for saving and
loading without an import cycle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from galva_ckpt.errors import CheckpointError

__all__ = ["ModelLayout", "ModuleLayout", "model_layout"]


class ModuleLayout(Protocol):
    """One Galva module: its name and its on-disk Hugging Face tensor names with full shapes."""

    @property
    def name(self) -> str: ...

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]: ...


class ModelLayout(Protocol):
    """Every module of a model in Galva order, and the tied aliases Hugging Face does not store."""

    @property
    def family(self) -> str: ...

    @property
    def modules(self) -> Sequence[ModuleLayout]: ...

    @property
    def tied(self) -> Mapping[str, str]: ...


def model_layout(config: Mapping[str, Any], source: str) -> ModelLayout:
    """The layout of the model a ``config.json`` dict describes; ``source`` names that file in errors."""
    try:
        from galva_models.checkpoint_names import checkpoint_names_from_dict
    except ImportError:
        raise CheckpointError(
            "converting needs galva-models (the model families): pip install 'galva-ckpt[hf]'"
        ) from None
    try:
        return checkpoint_names_from_dict(dict(config))
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        text = str(err).strip().splitlines()
        raise CheckpointError(f"{source}: {text[0] if text else type(err).__name__}") from None
