"""Real routing through the model's depth: the rows each expert of every mixture-of-experts layer receives when
random tokens run through the embedding and every layer in turn.

A deeper layer's input is no random vector: the residual stream carries what the layers before it added (at
initialisation, attention outputs much alike for every token), so its router may prefer some experts for every token
of a batch. On tiny Mixtral the first layer's busier ep-2 half gets 1.04 of the mean rows, the deeper ones' 1.15-1.21;
the profiled layer alone on random inputs sees only the first kind. Each layer is made real for its forward only
(:meth:`~galva_profiler.model_source.MetaModel.borrowed_layer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from galva_profiler.model_source import MetaModel


def routing_by_layer(
    model: MetaModel, experts_path: str, seq: int, batch: int, forwards: int, dtype: torch.dtype, seed: int
) -> dict[int, list[Tensor]]:
    """``{layer index: rows per expert in each forward}`` for every layer holding ``experts_path``, over
    ``forwards`` batches of ``batch x seq`` random tokens (the same tokens on every run: ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    inputs = [torch.randint(0, vocab, (batch, seq), generator=generator) for _ in range(forwards)]
    counts: dict[int, list[Tensor]] = {}
    with torch.no_grad():
        hidden = [model.embedding(dtype)(ids) for ids in inputs]
        for index in range(model.num_layers):
            with model.borrowed_layer(index, dtype) as layer:
                experts = _find(layer, experts_path)
                seen: list[Tensor] = []
                handle = experts.register_forward_pre_hook(_recorder(seen)) if experts is not None else None
                try:
                    hidden = [layer(h) for h in hidden]
                finally:
                    if handle is not None:
                        handle.remove()
                if experts is not None:
                    total = int(next(experts.parameters(recurse=False)).shape[0])
                    counts[index] = [torch.bincount(s.reshape(-1), minlength=total).double() for s in seen]
    return counts


def _recorder(seen: list[Tensor]) -> Any:
    """A forward pre-hook keeping the experts module's ``top_k_index`` argument."""

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(args[1])

    return record


def _find(layer: nn.Module, path: str) -> nn.Module | None:
    inner = getattr(layer, "layer", layer)
    try:
        return inner.get_submodule(path)
    except AttributeError:
        return None
