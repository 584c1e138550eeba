"""Per-layer activation checkpointing: keep only a layer's input in forward and recompute the rest in backward."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Checkpointed", "unwrapped_name"]


class Checkpointed(nn.Module):
    """Runs ``inner`` under non-reentrant checkpointing. Placed inside the data-parallel unit, so a zero3 layer's
    parameters are gathered once for backward and serve the recomputation too."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def unwrapped_name(name: str) -> str:
    """A parameter name as the model without the :class:`Checkpointed` wrapper names it (its ``inner.`` dropped):
    ``inner.fc.weight`` -> ``fc.weight``, ``layers.3.inner.fc.weight`` -> ``layers.3.fc.weight``."""
    return name.removeprefix("inner.") if name.startswith("inner.") else name.replace(".inner.", ".", 1)
