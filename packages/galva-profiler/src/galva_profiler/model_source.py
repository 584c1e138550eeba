"""Which model is profiled, built on the meta device, with only the modules being measured made real.

The Hugging Face model is constructed under ``torch.device("meta")`` (no storage, so a 70B model costs nothing)
and decomposed by its galva-models adapter into embedding, layers and head. :meth:`MetaModel.layer` then
materialises one layer (galva-hp's ``materialize`` with Hugging Face's own initialiser): the profile needs the first
layer of each layer type, never the whole model. :attr:`MetaModel.built` records what was materialised, so a test
can hold the profiler to that. A mixture of experts' routing is measured through the model's depth
(:mod:`galva_profiler.routing`): there :meth:`MetaModel.borrowed_layer` makes one more layer real for a forward and
returns it to the meta device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from galva_profiler.errors import ProfileError
from galva_schema.vocabulary import layer_module


def load_config(preset: str | None, config_dir: str | None) -> tuple[Any, str]:
    """The transformers config of a galva-models preset or of a config / checkpoint directory, and a model name."""
    if (preset is None) == (config_dir is None):
        raise ProfileError("give exactly one of --model PRESET or --model-config DIR (a config or checkpoint dir)")
    if preset is not None:
        from galva_models.presets import UnknownPresetError, preset_config

        try:
            return preset_config(preset), preset
        except UnknownPresetError as err:
            raise ProfileError(str(err)) from None
    directory = Path(config_dir)  # type: ignore[arg-type]
    if not (directory / "config.json").is_file():
        raise ProfileError(f"{directory}: no config.json (expected a Hugging Face config or checkpoint directory)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True), directory.resolve().name
    except (OSError, ValueError) as err:
        raise ProfileError(f"{directory}: cannot read config.json: {str(err).splitlines()[0]}") from None


@dataclass
class MetaModel:
    """A model decomposed on the meta device; modules become real one at a time, on request."""

    config: Any
    name: str
    adapter: Any  # galva_models.tables.family.FamilyAdapter
    hf_model: nn.Module
    layered: Any  # galva_hp.model.LayeredModel
    seed: int = 0
    built: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, config: Any, name: str, seed: int = 0) -> MetaModel:
        from galva_models.tables.registry import adapter_for

        try:
            adapter = adapter_for(config)
        except ValueError as err:
            raise ProfileError(str(err)) from None
        with torch.device("meta"):
            hf_model = adapter.build_model(config, attn_implementation="sdpa")
        return cls(config, name, adapter, hf_model, adapter.decompose(hf_model), seed)

    @property
    def num_layers(self) -> int:
        return int(self.layered.num_layers)

    def layer_runs(self) -> list[tuple[str, int, int]]:
        """``(layer type, first index, count)`` of every contiguous run of one layer type, in model order."""
        runs: list[tuple[str, int, int]] = []
        for index, kind in enumerate(self.layered.layer_types):
            if runs and runs[-1][0] == kind:
                runs[-1] = (kind, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((kind, index, 1))
        return runs

    def _materialize(self, name: str, module: nn.Module, dtype: torch.dtype) -> nn.Module:
        from galva_hp.deferred_init import is_meta, materialize
        from galva_models.tables.family import hf_init_fn

        if is_meta(module):
            self.built.append(name)
        try:
            materialize(name, module, hf_init_fn(self.hf_model, self.seed))
        except RuntimeError as err:  # the allocation itself: the module does not fit this machine
            raise ProfileError(
                f"{self.name}: cannot build {name} on this machine: {str(err).splitlines()[0]}"
            ) from None
        return module.to(dtype)

    def layer(self, index: int, dtype: torch.dtype) -> nn.Module:
        """Layer ``index``, materialised (the other layers stay on the meta device)."""
        return self._materialize(layer_module(index), self.layered.layers[index], dtype)

    @contextmanager
    def borrowed_layer(self, index: int, dtype: torch.dtype) -> Iterator[nn.Module]:
        """Layer ``index`` real inside the block (the values :meth:`layer` gives it), back on the meta device after
        unless the sweep had made it real; not recorded in :attr:`built`."""
        from galva_hp.deferred_init import is_meta

        module = self.layered.layers[index]
        if not is_meta(module):
            yield module
            return
        name = layer_module(index)
        try:
            yield self._materialize(name, module, dtype)
        finally:
            module.to_empty(device="meta")
            if name in self.built:
                self.built.remove(name)

    def embedding(self, dtype: torch.dtype) -> nn.Module:
        return self._materialize("embedding", self.layered.embedding, dtype)

    def head(self, dtype: torch.dtype) -> nn.Module:
        return self._materialize("head", self.layered.head, dtype)

    def constraints(self, seq_length: int) -> Any:
        """The adapter's :class:`galva_schema.ModelConstraints` at this length."""
        return self.adapter.constraints(self.config, seq_length=seq_length)
