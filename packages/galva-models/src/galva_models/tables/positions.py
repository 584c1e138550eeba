"""Which of a layer's arguments hold one entry per position, and their cut to the positions a rank holds.

Under the sequence forms a layer runs on a slice of the sequence (Ulysses' slice, the ring's two chunks), while the
base model's forward computed its arguments for the whole sequence: rotary tables, position ids, a family's own
per-position tensors (Beam's query scale ``[batch, 1, seq, 1]``). Which axis of an argument is the sequence's is
found, not assumed, from two recordings of the same call at different lengths: the axes whose size follows the
length. An argument with one such axis is cut to the rank's positions along it; one with two or more (a mask, a
bias over pairs of positions) stays whole, as does anything named a mask (a key padding mask ``[batch, seq]`` is
read against the whole sequence the attention function sees).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["cut_to_positions", "sequence_axes"]

Axes = Any
"""The tree of an argument structure with, at each tensor, its sequence axis (None: not cut)."""


def sequence_axes(short: Any, long: Any, name: str = "") -> Axes:
    """The sequence axis of every tensor in ``short`` (a call's ``args`` or ``kwargs`` recorded at one length),
    from the same structure ``long`` recorded at another length; None where a tensor is not cut."""
    if isinstance(short, Tensor):
        if "mask" in name or not isinstance(long, Tensor) or long.dim() != short.dim():
            return None
        moved = [axis for axis in range(short.dim()) if short.shape[axis] != long.shape[axis]]
        return moved[0] if len(moved) == 1 else None
    if isinstance(short, dict) and isinstance(long, dict):
        return {k: sequence_axes(v, long.get(k), k if isinstance(k, str) else name) for k, v in short.items()}
    if isinstance(short, (tuple, list)) and isinstance(long, (tuple, list)) and len(short) == len(long):
        return _like(short, [sequence_axes(s, t, name) for s, t in zip(short, long, strict=True)])
    return None


def cut_to_positions(value: Any, axes: Axes, positions: Tensor) -> Any:
    """``value`` (recorded for the whole sequence) with each tensor that has a sequence axis in ``axes`` cut to
    ``positions`` along it."""
    if isinstance(value, Tensor):
        return value if axes is None else value.index_select(axes, positions.to(value.device))
    if isinstance(value, dict) and isinstance(axes, dict):
        return {k: cut_to_positions(v, axes.get(k), positions) for k, v in value.items()}
    if isinstance(value, (tuple, list)) and isinstance(axes, (tuple, list)):
        return _like(value, [cut_to_positions(v, a, positions) for v, a in zip(value, axes, strict=True)])
    return value


def _like(container: tuple[Any, ...] | list[Any], items: list[Any]) -> Any:
    """``items`` in a container of ``container``'s type (a named tuple's fields by position)."""
    if isinstance(container, list):
        return items
    return type(container)(*items) if hasattr(container, "_fields") else tuple(items)
