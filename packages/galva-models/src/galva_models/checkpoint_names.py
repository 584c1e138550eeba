"""Which Hugging Face checkpoint tensors belong to which Galva module, for a config (used by galva-ckpt).

A Galva checkpoint stores one file per module of the :class:`~galva_hp.model.LayeredModel` (``embedding``,
``layers.0`` ... ``layers.N-1``, ``head``) holding full tensors under the names Hugging Face writes to disk. This
module answers, from the config alone, which on-disk names each module holds, their full shapes, which on-disk
names are tied aliases of another (stored once), and which Galva parameter each name is, or which block of one (a
mixture of experts' fused expert tensors are one tensor per expert and projection on disk).

Everything is found on the meta device (no memory, no initialisation): the family adapter builds and decomposes
the model, :func:`~galva_models.tables.family.parameter_name_map` gives each Galva parameter's in-memory Hugging
Face name, and transformers' own save-time conversion turns in-memory tensors into on-disk ones (renamed for ViT and
Swin in transformers 5, cut into blocks for the experts: :mod:`galva_models.stored_parts`), so the names are
exactly what ``save_pretrained`` writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from galva_hp.model import LayeredModel
from galva_models.stored_parts import StoredPart, stored_parts
from galva_models.tables.family import Task, parameter_name_map
from galva_models.tables.registry import adapter_for
from galva_schema.vocabulary import layer_module, layer_of_module

__all__ = [
    "CheckpointNames",
    "ModuleNames",
    "StoredPart",
    "checkpoint_names",
    "checkpoint_names_from_dict",
    "config_from_dict",
]


@dataclass(frozen=True)
class ModuleNames:
    """One Galva module's tensors as a Hugging Face checkpoint stores them."""

    name: str
    """Galva module name: ``embedding``, ``layers.<i>`` or ``head``."""
    shapes: dict[str, tuple[int, ...]]
    """On-disk Hugging Face name -> full (unsharded) shape, in the model's order. Tied aliases are not listed."""
    galva_names: dict[str, str]
    """Galva parameter name (``layers.3.layer.attn.c_attn.weight``) -> on-disk Hugging Face name (possibly a name
    another module stores, for a tied weight), for a parameter stored whole."""
    parts: dict[str, tuple[StoredPart, ...]] = field(default_factory=dict)
    """Galva parameter name -> the on-disk tensors that are blocks of it, for a parameter stored as several (a
    mixture of experts' ``experts.gate_up_proj``: one ``gate`` and one ``up`` tensor per expert)."""
    buffers: dict[str, str] = field(default_factory=dict)
    """Galva name -> on-disk name of each persistent buffer the module stores (Apertus's xIELU ``beta``/``eps``):
    state Hugging Face saves that no optimizer updates, whole on every rank that holds the module."""


@dataclass(frozen=True)
class CheckpointNames:
    """Every module of a model with its on-disk tensor names, in Galva order."""

    family: str
    """The family adapter's name, or the ``model_type`` for a family run from its tables."""
    model_type: str
    """Hugging Face ``model_type`` of the config."""
    modules: tuple[ModuleNames, ...]
    tied: dict[str, str]
    """On-disk name Hugging Face does not store (a tied alias) -> the stored name it equals."""


def config_from_dict(config_dict: dict[str, Any]) -> Any:
    """A transformers config from a ``config.json`` dict; ``ValueError`` for an unknown or missing ``model_type``."""
    from transformers import CONFIG_MAPPING

    model_type = config_dict.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(f"config has no known model_type (got {model_type!r})")
    return CONFIG_MAPPING[model_type].from_dict(dict(config_dict))


def checkpoint_names_from_dict(config_dict: dict[str, Any]) -> CheckpointNames:
    """:func:`checkpoint_names` for a ``config.json`` dict."""
    return checkpoint_names(config_from_dict(config_dict))


def checkpoint_names(config: Any) -> CheckpointNames:
    """The module-by-module on-disk tensor names of ``config``'s model (see the module docstring).

    Raises ``ValueError`` for a ``model_type`` no adapter handles.
    """
    adapter = adapter_for(config)
    with torch.device("meta"):
        hf_model = adapter.build_model(config, attn_implementation="sdpa")
    # an encoder-decoder needs a boundary position to decompose; it changes no parameter
    options = {"encoder_seq_length": 1} if adapter.task is Task.SEQ2SEQ_LM else {}
    layered = adapter.decompose(hf_model, **options)
    stored, tied_memory = _stored_and_tied(hf_model)
    to_disk = {memory: stored_parts(hf_model, memory, tuple(t.shape)) for memory, t in stored.items()}
    galva_to_memory = parameter_name_map(hf_model, layered)
    held_by = _module_of_each_name(hf_model, layered, galva_to_memory)
    galva_buffers = _buffer_name_map(hf_model, layered)

    modules: list[ModuleNames] = []
    for module_name in _module_names(layered):
        shapes = {
            part.tensor: part.shape
            for memory in stored
            if held_by.get(memory) == module_name
            for part in to_disk[memory]
        }
        galva: dict[str, str] = {}
        parts: dict[str, tuple[StoredPart, ...]] = {}
        for galva_name, memory in galva_to_memory.items():
            if galva_name == module_name or galva_name.startswith(module_name + "."):
                blocks = to_disk[tied_memory.get(memory, memory)]
                if _whole(blocks, stored[tied_memory.get(memory, memory)]):
                    galva[galva_name] = blocks[0].tensor
                else:
                    parts[galva_name] = tuple(blocks)
        buffers = {
            galva_name: _whole_name(to_disk[memory], stored[memory], memory)
            for galva_name, memory in galva_buffers.items()
            if _module_prefix(galva_name) == module_name and memory in stored
        }
        modules.append(ModuleNames(module_name, shapes, galva, parts, buffers))
    unplaced = sorted(p.tensor for m in stored if m not in held_by for p in to_disk[m])
    if unplaced:
        raise ValueError(f"{adapter.name}: tensors in no Galva module: {', '.join(unplaced[:5])}")
    tied = {
        _whole_name(stored_parts(hf_model, alias, tuple(stored[target].shape)), stored[target], alias): _whole_name(
            to_disk[target], stored[target], target
        )
        for alias, target in tied_memory.items()
    }
    family = adapter.name if adapter.model_types else str(config.model_type)
    return CheckpointNames(family, str(config.model_type), tuple(modules), tied)


def _module_names(layered: LayeredModel) -> list[str]:
    return [name for name, _ in _parts(layered)]


def _stored_and_tied(hf_model: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """In-memory names ``save_pretrained`` stores (with their meta tensors), and tied alias -> stored name."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = hf_model.state_dict()  # persistent buffers included, non-persistent ones not (as on disk)
    for name, param in hf_model.named_parameters(remove_duplicate=False):
        state.setdefault(name, param)  # tied aliases, so that transformers picks which one to keep
    kept = remove_tied_weights_from_state_dict(dict(state), hf_model)
    owner = {id(_tensor_of(hf_model, name)): name for name in kept}
    tied = {name: owner[id(_tensor_of(hf_model, name))] for name in state if name not in kept}
    return dict(kept), tied


def _tensor_of(hf_model: Any, name: str) -> Any:
    return hf_model.get_parameter_or_buffer(name)


def _whole(parts: list[StoredPart], tensor: torch.Tensor) -> bool:
    """Whether ``parts`` is the whole tensor under one name (a renaming at most)."""
    whole = parts[0]
    return len(parts) == 1 and whole.sizes == tuple(tensor.shape) and whole.axes == tuple(range(tensor.dim()))


def _whole_name(parts: list[StoredPart], tensor: torch.Tensor, memory_name: str) -> str:
    if not _whole(parts, tensor):
        raise ValueError(f"{memory_name}: transformers stores this tied weight or buffer as blocks; galva-ckpt cannot")
    return parts[0].tensor


def _module_of_each_name(hf_model: nn.Module, layered: LayeredModel, galva_to_memory: dict[str, str]) -> dict[str, str]:
    """In-memory Hugging Face name -> the Galva module that holds it (first holder for a shared tensor)."""
    out: dict[str, str] = {}
    for galva_name, memory in galva_to_memory.items():
        out.setdefault(memory, _module_prefix(galva_name))
    buffer_names = {id(b): n for n, b in hf_model.named_buffers()}
    for module_name, module in _parts(layered):
        for _, buffer in module.named_buffers():
            if id(buffer) in buffer_names:
                out.setdefault(buffer_names[id(buffer)], module_name)
    return out


def _buffer_name_map(hf_model: nn.Module, layered: LayeredModel) -> dict[str, str]:
    """Galva buffer name -> in-memory Hugging Face name, matched by identity (first Galva holder of each)."""
    memory = {id(b): n for n, b in hf_model.named_buffers()}
    out: dict[str, str] = {}
    seen: set[int] = set()
    for prefix, module in _parts(layered):
        for name, buffer in module.named_buffers():
            if id(buffer) in memory and id(buffer) not in seen:
                seen.add(id(buffer))
                out[f"{prefix}.{name}"] = memory[id(buffer)]
    return out


def _parts(layered: LayeredModel) -> list[tuple[str, nn.Module]]:
    return layered.galva_modules()


def _module_prefix(galva_name: str) -> str:
    index = layer_of_module(galva_name)
    return galva_name.partition(".")[0] if index is None else layer_module(index)
