"""What a table entry cannot say: the per-layer facts a family's config fixes, given by a small hook beside its
entry (:data:`~.plans.GALVA_TABLES`), and how a nested layer list is walked.

A table entry names modules and styles. A family whose layers differ stage by stage (Swin: the hidden size doubles
and the patch grid shrinks at every patch merging) also says, per layer, what the base model's forward hands it and
what its boundary holds (:class:`LayerShape`); Galva then runs the family's own modules with those arguments instead
of recording them from the base forward (whose embedding side returns the grid with the hidden states).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from galva_models.tables.errors import UnsupportedModel

__all__ = ["LayerShape", "layer_lists", "layer_stack"]


@dataclass(frozen=True)
class LayerShape:
    """One layer of a family whose layers differ by stage."""

    layer_type: str
    """The layer type (``swin_stage2``): layers of one type share their shapes and heads."""
    heads: int
    hidden: int
    """The hidden size at the layer's input."""
    tokens: int
    """Tokens at the layer's input (the stage's patch grid)."""
    output_tokens: int | None = None
    """Tokens at its output where the stage ends there and merges patches; None: ``tokens``."""
    args: tuple[Any, ...] = ()
    """Positional arguments the base forward hands the layer after its hidden states (Swin: the grid's height and
    width); the layer runs on the whole grid, so Ulysses and cp are refused (:func:`~.adapter.constraints`), and
    Megatron-SP runs only through the family's own hook (``sequence_parallel``: Swin's gathers the grid)."""
    kwargs: dict[str, Any] = field(default_factory=dict)


def layer_lists(base: nn.Module, path: str) -> list[tuple[str, nn.ModuleList]]:
    """The layer lists a pipeline-table path names, with their paths: one (``h``, ``encoder.layer``), or, for a
    path with a ``*`` (``encoder.layers.*.blocks``), one per stage, in order."""
    try:
        if "*" not in path:
            return [(path, base.get_submodule(path))]  # type: ignore[list-item]
        outer, _, inner = path.partition(".*.")
        stages: list[nn.Module] = list(base.get_submodule(outer).children())
        return [(f"{outer}.{i}.{inner}", stage.get_submodule(inner)) for i, stage in enumerate(stages)]  # type: ignore[misc]
    except AttributeError:
        raise UnsupportedModel(
            f"{type(base).__name__} has no {path!r}, which its pipeline table names as its layers"
        ) from None


def layer_stack(base: nn.Module, path: str) -> list[nn.Module]:
    """Every layer of the lists at ``path``, in order: the Galva layers."""
    return [layer for _, layers in layer_lists(base, path) for layer in layers]
