"""Which layers mix tokens outside the attention function Galva registers (linear attention, state-space and
convolution layers, recurrent blocks): the forms that split the sequence cannot run them.

Galva's sequence forms (Ulysses, Megatron-SP's sequence slices, the context-parallel ring) give a layer a slice of
the sequence and make only the registered attention function (:mod:`.attention`) see the whole of it. A layer whose
output at one position reads other positions by another path would compute something else. Which layers do is
found by running the family's own code, not by its names: a tiny copy of the config (widths cut, every layer kept)
runs with an attention function that reads no other position, and a layer mixes tokens elsewhere where its last
position's output has a gradient on its input's earlier positions, where the mask it hands the attention function
is computed from its activations, or where, run on the sequence's second half as the sequence forms run it (the
arguments with one entry per position cut to it, :mod:`.positions`), it fails or computes other values than on the
whole: that also finds what carries no gradient (a top-k selection of keys, DeepSeek's sparse-attention indexer).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from galva_models.tables.positions import cut_to_positions, sequence_axes

__all__ = ["HiddenMixers", "hidden_mixers"]

_PROBE = "galva_probe"
_SEQ = 6


@dataclass(frozen=True)
class HiddenMixers:
    """Per layer, whether it mixes tokens outside the registered attention, and the names of the modules that only
    those layers hold (where some layers do not mix: what sets them apart, e.g. ``linear_attn``)."""

    layers: tuple[bool, ...]
    modules: tuple[str, ...]
    paths: frozenset[str]
    """Every module path some layer has (a table entry for none of them names a module this config leaves out)."""


def _no_mixing(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Any:
    """An attention function whose output at a position reads that position only (its value, heads repeated). A
    mask computed from the activations (Doge's dynamic mask) marks the module: it is built on a sequence slice's
    tokens before the function could gather them."""
    mask = args[0] if args else kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.requires_grad:
        module.galva_mask_from_activations = True  # type: ignore[assignment]
    heads = query.shape[1]
    out = value.repeat_interleave(heads // value.shape[1], dim=1) if heads % value.shape[1] == 0 else value
    return out.transpose(1, 2).contiguous() + 0 * query.sum(), None


def _register() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _PROBE not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(_PROBE, _no_mixing)
        ALL_MASK_ATTENTION_FUNCTIONS.register(_PROBE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def hidden_mixers(config: Any, layers_path: str) -> HiddenMixers | None:
    """The layers of ``config``'s layer stack (``layers_path`` in the base model) that mix tokens outside the
    registered attention; None where the probe cannot run the family (it is then no evidence either way)."""
    return _probe(config.to_json_string(), layers_path)


@functools.lru_cache(maxsize=32)
def _probe(config_json: str, layers_path: str) -> HiddenMixers | None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from galva_models.presets import tiny_sizes

    raw = json.loads(config_json)
    config = tiny_sizes(AutoConfig.for_model(raw.pop("model_type"), **raw), layers=None)
    _register()
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=_PROBE)
        stack = list(model.base_model.get_submodule(layers_path))
        inputs: list[Tensor] = []
        outputs: list[Tensor] = []

        def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if args:
                inputs.append(args[0].detach().requires_grad_())
                return (inputs[-1], *args[1:]), kwargs
            inputs.append(kwargs["hidden_states"].detach().requires_grad_())
            return args, {**kwargs, "hidden_states": inputs[-1]}

        def leave(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            outputs.append(out[0] if isinstance(out, (tuple, list)) else out)

        hooks = [h for layer in stack for h in (layer.register_forward_pre_hook(enter, with_kwargs=True),
                                                 layer.register_forward_hook(leave))]  # fmt: skip
        ids = torch.arange(_SEQ).remainder(config.vocab_size).unsqueeze(0)
        model.train()
        # an explicit all-ones mask: ids may hold the pad token, and without a mask transformers writes its advice
        # about padding to the command's stderr (galva-ckpt's one-line errors)
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        for hook in hooks:
            hook.remove()
        torch.stack([out[:, -1].sum() for out in outputs]).sum().backward()
        sliced = _slice_agrees(model, stack, config.vocab_size)
    except Exception:  # a family the tiny copy cannot run: the build itself will say why
        return None
    masked = [any(getattr(m, "galva_mask_from_activations", False) for m in layer.modules()) for layer in stack]
    mixing = tuple(
        bool(x.grad is not None and x.grad[:, :-1].abs().max() > 0) or mask or not agrees
        for x, mask, agrees in zip(inputs, masked, sliced, strict=True)
    )
    plain = {type(m) for layer, mixes in zip(stack, mixing, strict=True) if not mixes for m in layer.modules()}
    names = sorted(
        {
            name
            for layer, mixes in zip(stack, mixing, strict=True)
            if mixes
            for name, child in layer.named_children()
            if plain and type(child) not in plain
        }
    )
    paths = frozenset(name for layer in stack for name, _ in layer.named_modules() if name)
    return HiddenMixers(mixing, tuple(names), paths)


def _slice_agrees(model: nn.Module, stack: list[nn.Module], vocab: int) -> list[bool]:
    """Per layer, whether it computes on the sequence's second half what it computes there on the whole sequence
    (its keyword arguments cut to those positions, the probe's attention reading no other position)."""
    model.eval()
    with torch.no_grad():
        whole = _calls(model, stack, _SEQ, vocab)
        shorter = _calls(model, stack, _SEQ // 2, vocab)
        half = torch.arange(_SEQ // 2, _SEQ)
        agrees: list[bool] = []
        for (hidden, args, kwargs, out), (_, _, other, _) in zip(whole, shorter, strict=True):
            layer = stack[len(agrees)]
            try:
                part = layer(hidden[:, half], *args, **cut_to_positions(kwargs, sequence_axes(kwargs, other), half))
                part = part[0] if isinstance(part, (tuple, list)) else part
                agrees.append(bool((part - out[:, half]).abs().max() <= 1e-5 * max(1.0, float(out.abs().max()))))
            except Exception:  # it cannot take a slice at all (a mask or table sized for the whole sequence)
                agrees.append(False)
    return agrees


def _calls(model: nn.Module, stack: list[nn.Module], seq: int, vocab: int) -> list[tuple[Any, ...]]:
    """Each layer's ``(hidden, args, kwargs, output)`` in a forward over ``seq`` tokens."""
    calls: list[list[Any]] = []

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if args:
            calls.append([args[0], args[1:], kwargs])
        else:
            calls.append([kwargs["hidden_states"], (), {k: v for k, v in kwargs.items() if k != "hidden_states"}])

    def leave(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        calls[-1].append(out[0] if isinstance(out, (tuple, list)) else out)

    hooks = [h for layer in stack for h in (layer.register_forward_pre_hook(enter, with_kwargs=True),
                                             layer.register_forward_hook(leave))]  # fmt: skip
    ids = torch.arange(seq).remainder(vocab).unsqueeze(0)
    try:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [tuple(call) for call in calls]
