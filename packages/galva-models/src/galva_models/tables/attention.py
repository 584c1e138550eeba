"""Galva's attention forms as functions registered with transformers' attention interface.

Every family calls attention through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with query, key and
value after its own projections, norms and rotary embedding (``[batch, heads, seq, head_dim]``, key/value heads not
repeated). Galva registers ``galva_<inner>`` for each inner implementation (``sdpa``, ``eager``,
``flash_attention_2``): it looks at the form Galva attached to the calling attention module (:class:`AttentionForm`)
and, around the inner function,

- Ulysses: one all-to-all per tensor trades the sequence slice for a slice of the heads (key/value heads repeated
  first where the degree does not divide them), the inner function attends over the whole sequence, and one
  all-to-all takes the output back;
- tp with fewer key/value heads than ranks: the key/value projections are replicated and each rank keeps the heads
  its query heads read;
- attention-probability dropout draws from this rank's own stream where ranks hold different heads;
- context parallelism: ring attention (:mod:`galva_hp.parallel.ring_attention`) over the ring's whole sequence
  replaces the inner function; each rank holds its two chunks of the sequence, the mask is the whole sequence's
  (each block reads its part) and, inside a Ulysses group, the ring runs on the heads the all-to-all gave the rank.
  The ring computes plain scaled dot-product attention: a family whose attention adds to it (soft-capping, sinks,
  attention dropout) is refused by its constraints (:func:`.adapter.constraints`).

A module without a form calls the inner function unchanged, so a single-process model with ``galva_sdpa`` computes
what it computes with ``sdpa``. Masks: each name is registered with its inner implementation's mask function too
(without it transformers would hand the function no mask, and sliding windows would be lost).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.parallel.mappings import (
    differentiable_all_to_all,
    differentiable_all_to_all_many,
    group_rank,
    group_size,
)
from galva_hp.parallel.ring_attention import RingMask, ring_attention
from galva_hp.parallel.rng import rank_stream
from galva_hp.parallel.ulysses import ulysses_kv_repeat

__all__ = ["AttentionForm", "galva_implementation", "register"]

PREFIX = "galva_"
_HEADS, _SEQ = 1, 2  # query/key/value layout inside attention: [batch, heads, seq, head_dim]
_OUT_SEQ, _OUT_HEADS = 1, 2  # the output layout: [batch, seq, heads, head_dim]


@dataclass(frozen=True)
class AttentionForm:
    """What one attention module does in its layer's parallel form (attached as ``module.galva_attention``)."""

    sp_group: ProcessGroup | None = None
    """Ulysses group: the module's input holds a slice of the sequence."""
    kv_heads: tuple[int, int] | None = None
    """``(first, count)``: the key/value heads this rank reads when they are replicated over tp."""
    heads_group: ProcessGroup | None = None
    """The group whose ranks hold different heads (their dropout masks must differ)."""
    cp_group: ProcessGroup | None = None
    """The context-parallel ring: the module's input holds this rank's two chunks of the sequence."""
    cp_index: int = 0
    """This rank's place in the ring."""


def galva_implementation(inner: str) -> str:
    """The registered name wrapping ``inner`` (registering it on first use)."""
    register(inner)
    return PREFIX + inner


def register(inner: str) -> None:
    """Register ``galva_<inner>`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = PREFIX + inner
    if name in ALL_ATTENTION_FUNCTIONS:
        return
    ALL_ATTENTION_FUNCTIONS.register(name, _attention(inner))
    mask_inner = inner if inner in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_inner])


def _inner_function(inner: str, module: nn.Module) -> Callable[..., tuple[Tensor, Any]]:
    if inner == "eager":  # each family has its own eager attention (soft-capping, sinks, ...)
        return importlib.import_module(type(module).__module__).eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[inner]


class _ModuleView:
    """The attention module as the inner function sees it, with its key/value grouping for the local heads and its
    per-head parameters (attention sinks: one per query head) narrowed to them."""

    def __init__(self, module: nn.Module, num_key_value_groups: int, **narrowed: Tensor) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups
        self.__dict__.update(narrowed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _per_head(module: nn.Module, local: int, sp: ProcessGroup) -> dict[str, Tensor]:
    """Under Ulysses: the module's own parameters with one entry per query head, narrowed to this rank's heads
    (the all-to-all gives rank r heads ``[r * local, (r + 1) * local)``)."""
    heads, first = local * group_size(sp), local * group_rank(sp)
    return {n: p.narrow(0, first, local) for n, p in module.named_parameters(recurse=False) if p.shape[:1] == (heads,)}


def _attention(inner: str) -> Callable[..., tuple[Tensor, Any]]:
    def attention(
        module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
    ) -> tuple[Tensor, Any]:
        fn = _inner_function(inner, module)
        form: AttentionForm | None = getattr(module, "galva_attention", None)
        if form is None:
            return fn(module, query, key, value, attention_mask, **kwargs)
        if form.kv_heads is not None:
            first, count = form.kv_heads
            key, value = key.narrow(_HEADS, first, count), value.narrow(_HEADS, first, count)
        sp = form.sp_group
        if sp is not None:
            repeat = ulysses_kv_repeat(query.shape[_HEADS], key.shape[_HEADS], group_size(sp))
            if repeat > 1:
                key = key.repeat_interleave(repeat, dim=_HEADS)
                value = value.repeat_interleave(repeat, dim=_HEADS)
            query, key, value = differentiable_all_to_all_many((query, key, value), _HEADS, _SEQ, sp)
        view: Any = module
        groups = query.shape[_HEADS] // key.shape[_HEADS]
        narrowed = _per_head(module, query.shape[_HEADS], sp) if sp is not None else {}
        if narrowed or groups != getattr(module, "num_key_value_groups", groups):
            view = _ModuleView(module, groups, **narrowed)
        dropout = float(kwargs.get("dropout", 0.0) or 0.0)
        streams = dropout > 0 and form.heads_group is not None
        if form.cp_group is not None:
            out, weights = _ring(module, query, key, value, attention_mask, form, **kwargs), None
        else:
            with rank_stream(form.heads_group, query.device) if streams else contextlib.nullcontext():
                out, weights = fn(view, query, key, value, attention_mask, **kwargs)
        if sp is not None:
            out = differentiable_all_to_all(out, _OUT_SEQ, _OUT_HEADS, sp)  # [b, s/sp, heads, d]
        return out, weights

    return attention


_PLAIN = {"dropout", "scaling", "sliding_window", "is_causal", "position_ids", "cache_position"}
"""Keyword arguments of an attention call that the ring reads or that change nothing in plain attention."""


def _ring(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    form: AttentionForm,
    **kwargs: Any,
) -> Tensor:
    """Ring attention for one call: ``[b, local, heads, d]`` like the inner functions."""
    extra = sorted(k for k, v in kwargs.items() if k not in _PLAIN and v is not None and v is not False)
    if extra or (module.training and float(kwargs.get("dropout", 0.0) or 0.0) > 0):
        what = ", ".join(extra) or "attention dropout"
        raise ValueError(f"{type(module).__name__}: ring attention computes plain attention, not with {what}")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    scale = kwargs.get("scaling")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    window = kwargs.get("sliding_window") if mask is None else None  # a mask has the window in it
    assert form.cp_group is not None
    out = ring_attention(query, key, value, RingMask(mask, causal, window), form.cp_group, form.cp_index, scale)
    return out.transpose(1, 2).contiguous()
