"""Which Hugging Face tensors make up each Galva module of a model, asked of the installed layout provider.

The family knowledge (what is a layer, which names are tied) lives once, in the package that trains the families
(galva-models); galva-ckpt only consumes it through the small structural types below. The provider is found through
the ``galva_ckpt.model_layouts`` entry-point group, which galva-models declares, so galva-ckpt imports nothing of it
and galva-models (galva-train) can depend on galva-ckpt for saving and loading: the dependency runs one way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol

from galva_ckpt.errors import CheckpointError

__all__ = ["LAYOUT_GROUP", "ModelLayout", "ModuleLayout", "model_layout"]

LAYOUT_GROUP = "galva_ckpt.model_layouts"
"""Entry-point group of the functions ``config.json`` dict -> :class:`ModelLayout` (galva-models declares one)."""


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
    """The layout of the model a ``config.json`` dict describes; ``source`` names that file in errors.

    Every installed provider is asked in name order; the first that knows the model answers. A provider that does
    not raises ``ValueError`` (or ``TypeError``/``KeyError``/``AttributeError`` from a malformed config), and when
    none answers the first provider's reason is the error.
    """
    providers = _providers()
    if not providers:
        raise CheckpointError(
            "converting needs the package that knows the model families' tensor names: pip install galva-models"
        )
    reasons: list[str] = []
    for provider in providers:
        try:
            return provider(dict(config))
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            text = str(err).strip().splitlines()
            reasons.append(text[0] if text else type(err).__name__)
    raise CheckpointError(f"{source}: {reasons[0]}")


def _providers() -> list[Callable[[dict[str, Any]], ModelLayout]]:
    found = sorted(entry_points(group=LAYOUT_GROUP), key=lambda ep: ep.name)
    out = []
    for ep in found:
        try:
            out.append(ep.load())
        except ImportError as err:  # a provider whose own dependencies are missing: say which
            raise CheckpointError(f"model layout provider {ep.value!r} cannot be imported: {err}") from None
    return out
