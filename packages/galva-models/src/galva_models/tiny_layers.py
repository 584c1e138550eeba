"""Cutting a family's default config down to a few layers: the per-layer fields follow the layer count.

A transformers config describes its layers in two ways besides ``num_hidden_layers``: lists with one entry per layer
(``layer_types``, ``mlp_layer_types``, ``indexer_types``, a per-layer ``intermediate_size`` ...) and, for a
heterogeneous config, ``per_layer_config`` (overrides of global fields keyed by layer index; the global field then
cannot be read). Keeping the first few entries of a pattern can keep one kind only (the first 4 of 5 sliding + 1
full are all sliding), so the layers kept are chosen to hold every kind the full model has.
"""

from __future__ import annotations

from typing import Any


def per_layer_lists(config: Any) -> dict[str, list[Any]]:
    """The config's fields that hold one entry per layer: lists as long as ``num_hidden_layers`` (at least 2)."""
    layers = config.num_hidden_layers
    fields = config.to_dict() if layers and layers > 1 else {}
    return {k: list(v) for k, v in fields.items() if isinstance(v, list) and len(v) == layers}


def layers_kept(total: int, lists: dict[str, list[Any]], overrides: dict[int, dict[str, Any]], count: int) -> list[int]:
    """``count`` of ``total`` layer indices, in order, that hold every kind in ``lists`` and ``overrides`` where
    ``count`` allows: a layer is taken first when it brings a kind not yet held (the first layer always), then the
    earliest others."""
    if not lists and not overrides:  # the layers are alike: any count
        return list(range(count))
    if total <= count:
        return list(range(total))

    def kinds(i: int) -> set[tuple[str, str]]:
        own = {(k, repr(v[i])) for k, v in lists.items()}
        return own | {(k, repr(v)) for k, v in overrides.get(i, {}).items()} | {("override", str(i in overrides))}

    kept: list[int] = []
    held: set[tuple[str, str]] = set()
    for i in range(total):
        if len(kept) < count and not kinds(i) <= held:
            kept.append(i)
            held |= kinds(i)
    kept += [i for i in range(total) if i not in kept][: count - len(kept)]
    return sorted(kept)


def scaled(value: Any, default: Any, tiny: Any) -> Any:
    """A per-layer override of a field the tiny config resizes: ``tiny`` times the override's ratio to the family's
    default (at least 1), so a layer twice as wide stays twice as wide; other values unchanged."""
    numbers = all(isinstance(v, int) and not isinstance(v, bool) for v in (value, default, tiny))
    if not numbers or not default:
        return value
    return max(1, round(tiny * value / default))


def detach_overrides(config: Any) -> dict[int, dict[str, Any]]:
    """Remove ``config``'s per-layer overrides (its global fields become readable and settable) and return them."""
    spec = config.__dict__.get("_heterogeneity_spec")
    config.per_layer_config = None
    return dict(spec.per_layer_overrides) if spec is not None else {}


def keep_layers(
    config: Any, kept: list[int], lists: list[str], overrides: dict[int, dict[str, Any]], defaults: dict[str, Any]
) -> None:
    """Cut ``config`` to the layers ``kept``: the per-layer ``lists`` keep their entries, and ``overrides`` (from
    :func:`detach_overrides`) come back renumbered. A per-layer value of a field resized from its value in
    ``defaults`` is :func:`scaled` to the field's new global value: an override of the field, or an entry of a list
    named after it (``num_attention_heads_per_layer``)."""
    config.num_hidden_layers = len(kept)
    for field in lists:
        values = getattr(config, field)
        named_after = [k for k in defaults if field.startswith(k + "_") and defaults[k] != getattr(config, k, None)]
        base = max(named_after, key=len, default=None)
        if base is not None:
            values = [scaled(v, defaults[base], getattr(config, base)) for v in values]
        setattr(config, field, [values[i] for i in kept])
    renumbered = {
        new: {k: scaled(v, defaults.get(k), getattr(config, k, None)) for k, v in overrides[old].items()}
        for new, old in enumerate(kept)
        if old in overrides
    }
    if renumbered:
        config.per_layer_config = renumbered
