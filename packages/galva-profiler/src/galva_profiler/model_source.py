"""Which model is profiled, built on the meta device, with only the modules being measured made real.

The Hugging Face model is constructed under ``torch.device("meta")`` (no storage, so a 70B model costs nothing)
and decomposed by its galva-models adapter into embedding, layers and head. :meth:`MetaModel.layer` then
materialises one layer (galva-hp's ``materialize`` with Hugging Face's own initialiser): the profile needs the first
layer of each layer type, never the whole model. :attr:`MetaModel.built` records what was materialised, so a test
can hold the profiler to that. A mixture of experts' routing is measured through the model's depth
(:mod:`galva_profiler.routing`): there :meth:`MetaModel.borrowed_layer` makes one more layer real for a forward and
returns it to the meta device.

An encoder-decoder (T5) is cut for one length: its layers pass ``[encoder ; decoder]`` as one stream, so the cut
must know where the decoder part starts. The profile's sequence length is the encoder's, the decoder's the same
unless ``decoder_seq_length`` says otherwise (galva-train's ``--seq-length`` / ``--decoder-seq-length``);
:meth:`MetaModel.at_length` cuts the same modules again for each profiled length. A layer that reads a parameter
shared with other layers (a T5 stack's relative-position table, a galva-hp ``SharedWeight`` at home in the stack's
first layer) is made real with that home, and the weight reads the real tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

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
    decoder_seq_length: int | None = None
    """An encoder-decoder's decoder length (None: as long as the encoder, the profile's sequence length)."""
    seq_length: int | None = None
    """The length :attr:`layered` is cut for (None: any; only an encoder-decoder's cut depends on it)."""

    @classmethod
    def build(
        cls, config: Any, name: str, seed: int = 0, seq_length: int | None = None, decoder_seq_length: int | None = None
    ) -> MetaModel:
        """The model on the meta device, cut for ``seq_length`` (an encoder-decoder needs it; others ignore it)."""
        from galva_models.tables.family import Task
        from galva_models.tables.registry import adapter_for

        try:
            adapter = adapter_for(config)
        except ValueError as err:
            raise ProfileError(str(err)) from None
        if decoder_seq_length is not None and adapter.task is not Task.SEQ2SEQ_LM:
            raise ProfileError(f"--decoder-seq-length: {name or adapter.name} has no decoder stream; use --seq-lengths")
        with torch.device("meta"):
            hf_model = adapter.build_model(config, attn_implementation="sdpa")
        model = cls(config, name, adapter, hf_model, None, seed, decoder_seq_length=decoder_seq_length)
        model.layered = model._cut(seq_length)
        return model

    @classmethod
    def of_profile(cls, config: Any, profile: Any, name: str = "") -> MetaModel:
        """The model ``profile`` (a :class:`galva_schema.ModelProfile`) describes, cut at its length; an
        encoder-decoder's decoder length is read back from the tokens its layers pass (its constraints'
        ``seq_length``: encoder plus decoder) less the profile's length (the encoder's)."""
        seq = profile.layer_types[0].seq_length
        model = cls.build(config, name, seq_length=seq)
        types = profile.constraints.layer_types if profile.constraints is not None else ()
        boundary = types[0].seq_length if types else None
        if model.encoder_decoder and boundary is not None and boundary - seq not in (seq, model.decoder_seq_length):
            model.decoder_seq_length = boundary - seq
            model.layered = model._cut(seq)
        return model

    @property
    def encoder_decoder(self) -> bool:
        """Whether the model passes ``[encoder ; decoder]`` between its layers (its cut depends on the lengths)."""
        from galva_models.tables.family import Task

        return bool(self.adapter.task is Task.SEQ2SEQ_LM)

    def decoder_length(self, seq_length: int) -> int | None:
        """The decoder length at profile length ``seq_length`` (None: the model has no decoder stream)."""
        return (self.decoder_seq_length or seq_length) if self.encoder_decoder else None

    def _cut(self, seq_length: int | None) -> Any:
        from galva_models.tables.family import length_options

        if self.encoder_decoder and seq_length is None:
            raise ProfileError(f"{self.name or self.adapter.name}: an encoder-decoder is cut for a sequence length")
        options = length_options(self.adapter.task, seq_length, self.decoder_seq_length)
        try:
            layered = self.adapter.decompose(self.hf_model, **options)
        except ValueError as err:
            raise ProfileError(f"{self.name or self.adapter.name}: {str(err).splitlines()[0]}") from None
        self.seq_length = seq_length if options else None
        return layered

    def at_length(self, seq_length: int) -> MetaModel:
        """This model cut for ``seq_length``: an encoder-decoder is cut again (the same modules, so what was made
        real stays real, and shared weights read the real tensors); any other model is returned as it is."""
        if self.encoder_decoder and seq_length != self.seq_length:
            # making a module real gave it new parameters, so Hugging Face's tied weights (T5's token table in the
            # encoder, decoder and head) are no longer one tensor: tied again, as the cut needs them
            cast(Any, self.hf_model).tie_weights()
            self.layered = self._cut(seq_length)
        return self

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
        module.to(dtype)
        self._read_shared(name, module, dtype)
        return module

    def _read_shared(self, name: str, module: nn.Module, dtype: torch.dtype) -> None:
        """Point every weight ``name`` reads through (not held in place) at its home's real tensor, making the home
        real first: materialising gave the home new parameters, and the weight still named the meta one."""
        modules = dict(self.layered.galva_modules())
        for weight in self.layered.shared:
            if weight.in_place or name not in weight.users:
                continue
            home = modules[weight.home]
            if home is not module:
                self._materialize(weight.home, home, dtype)
            weight.param = home.get_parameter(weight.path)

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
        decoder = self.decoder_length(seq_length)
        if decoder is None:
            return self.adapter.constraints(self.config, seq_length=seq_length)
        return self.adapter.constraints(self.config, seq_length=seq_length, decoder_seq_length=decoder)
