"""How ``save_pretrained`` stores an in-memory tensor: the blocks of it that are its on-disk tensors.

transformers 5 keeps some weights in memory in another form than on disk and converts them on save with the
family's conversion mapping: a renamed tensor (ViT's attention), or a fused tensor cut into many (a mixture of
experts' ``experts.gate_up_proj [E, 2F, H]`` is ``experts.<e>.w1.weight`` and ``experts.<e>.w3.weight`` on disk).
Rather than read those mappings, :func:`stored_parts` runs transformers' own save-time conversion on a probe: a
meta tensor (no memory) whose copies are no-ops, so every on-disk tensor comes out as a *view* of the probe, and the
view's offset and strides say which block of the in-memory tensor it is and in which axis order. A conversion that
is not a set of blocks (a sum, an interleave that copies, several in-memory tensors into one on-disk tensor) is
refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["StoredPart", "stored_parts"]


@dataclass(frozen=True)
class StoredPart:
    """One on-disk tensor that is a block of an in-memory tensor: ``tensor`` is the block ``offsets`` / ``sizes``
    of it, its axes in the order ``axes`` (``axes[j]``: the in-memory axis of on-disk axis ``j``; None for an
    on-disk axis of size 1 that the in-memory tensor lacks). In-memory axes of size 1 in the block and in no
    entry of ``axes`` are dropped on disk (the expert axis of a per-expert tensor)."""

    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    axes: tuple[int | None, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The on-disk tensor's full shape."""
        return self.disk_sizes(self.sizes)

    def disk_sizes(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """On-disk sizes of a sub-block of this part with in-memory ``sizes``."""
        return tuple(1 if a is None else sizes[a] for a in self.axes)

    def disk_offsets(self, offsets: tuple[int, ...]) -> tuple[int, ...]:
        """On-disk offsets of a sub-block of this part starting at in-memory ``offsets``."""
        return tuple(0 if a is None else offsets[a] - self.offsets[a] for a in self.axes)

    def _order(self) -> list[int]:
        mapped = [a for a in self.axes if a is not None]
        return mapped + [a for a in range(len(self.sizes)) if a not in mapped]

    def to_disk(self, block: Tensor) -> Tensor:
        """A sub-block of this part (in-memory layout) in the on-disk layout."""
        return block.permute(self._order()).reshape(self.disk_sizes(tuple(block.shape)))

    def from_disk(self, block: Tensor, sizes: tuple[int, ...]) -> Tensor:
        """An on-disk block back in the in-memory layout, as the sub-block of in-memory ``sizes``."""
        order = self._order()
        inverse = [order.index(a) for a in range(len(order))]
        return block.reshape([sizes[a] for a in order]).permute(inverse)


class _Probe(Tensor):
    """A meta tensor whose ``contiguous`` is itself: conversions that copy their blocks then return views."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is Tensor.contiguous:
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


def stored_parts(hf_model: Any, memory_name: str, shape: tuple[int, ...]) -> list[StoredPart]:
    """The on-disk tensors ``save_pretrained`` writes for the in-memory tensor ``memory_name`` of ``shape``, each a
    block of it (a plain renaming is one part, the whole tensor); ``ValueError`` naming the tensor otherwise."""
    from transformers.core_model_loading import revert_weight_conversion

    probe = torch.empty(shape, device="meta").as_subclass(_Probe)
    root = probe._base if probe._base is not None else probe
    out = revert_weight_conversion(hf_model, {memory_name: probe})
    parts = []
    for disk_name, view in out.items():
        part = _block_of(view, root, shape) if isinstance(view, Tensor) else None
        if part is None:
            raise ValueError(
                f"{memory_name}: transformers converts this weight on save into {disk_name}, which is not a block of "
                "it; galva-ckpt stores blocks and renames only"
            )
        parts.append(StoredPart(disk_name, *part))
    if sum(_numel(p.sizes) for p in parts) != _numel(shape):
        raise ValueError(f"{memory_name}: transformers' save-time conversion does not store each element once")
    return parts


def _block_of(
    view: Tensor, root: Tensor, shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int | None, ...]] | None:
    """(offsets, sizes, axes) of ``view`` inside a contiguous tensor of ``shape``, or None if it is no block of it."""
    if view is not root and view._base is not root:
        return None
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    rest, offsets = view.storage_offset(), []
    for stride in strides:
        offsets.append(rest // stride)
        rest -= offsets[-1] * stride
    sizes = [1] * len(shape)
    axes: list[int | None] = []
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:  # an axis of size 1: the in-memory one of size 1 it stands for, if any (else a new one)
            match = [d for d in range(len(shape)) if shape[d] == 1 and d not in axes]
        else:
            match = [d for d in range(len(shape)) if shape[d] > 1 and strides[d] == stride and d not in axes]
        if not match and size != 1:
            return None
        axes.append(match[0] if match else None)
        if match:
            sizes[match[0]] = size
    if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
        return None
    return tuple(offsets), tuple(sizes), tuple(axes)


def _numel(sizes: tuple[int, ...]) -> int:
    out = 1
    for n in sizes:
        out *= n
    return out
