"""Weights to load, read slice by slice: a Galva checkpoint (or a save root), or a Hugging Face directory.

:func:`open_weights` picks the kind from the directory: ``manifest.json`` is a Galva checkpoint, ``step-*``
children a save root (its newest complete save; partial ones are named in a warning), ``config.json`` with
safetensors weights a Hugging Face checkpoint (h2g is not needed first). Both kinds answer the same questions:
the model config, each tensor's shape and dtype, one block of one tensor; only a Galva training checkpoint also
holds optimizer state, scheduler, data position and RNG.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from galva_ckpt.checkpoint import CheckpointReader
from galva_ckpt.errors import CheckpointError
from galva_ckpt.format import HF_DIR, MANIFEST
from galva_ckpt.hf import CONFIG, INDEX, SINGLE, read_hf_weights, read_side_files
from galva_ckpt.reading import read_slice
from galva_ckpt.saves import latest_checkpoint
from galva_schema.checkpoint import CheckpointManifest, TensorInfo

__all__ = ["GalvaWeights", "HFDirectory", "WeightSource", "open_weights", "resolve", "resolve_save"]


class WeightSource(ABC):
    """What a loader asks of a checkpoint. ``manifest`` is None for a Hugging Face directory."""

    directory: Path
    manifest: CheckpointManifest | None = None

    @property
    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The Hugging Face config as a dict."""

    @abstractmethod
    def info(self, tensor: str) -> TensorInfo | None:
        """Full shape and dtype of a stored tensor (None if absent)."""

    @abstractmethod
    def where(self, tensor: str) -> Path:
        """The file that holds (or should hold) ``tensor``, for messages."""

    @abstractmethod
    def read_slice(self, tensor: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The ``index`` slice of a stored tensor, read without loading the rest."""

    def read_optimizer_slice(self, tensor: str, state: str, index: tuple[slice, ...]) -> torch.Tensor:
        raise CheckpointError(f"{self.directory}: holds no optimizer state (a Hugging Face checkpoint)")

    def optimizer_info(self, tensor: str, state: str) -> TensorInfo | None:
        return None

    def read_rng(self) -> dict[str, torch.Tensor]:
        return {}

    def read_side_files(self) -> dict[str, bytes]:
        """The Hugging Face side files kept with the weights (tokenizer, generation config), by file name."""
        return read_side_files(self.directory)


class GalvaWeights(WeightSource):
    """A Galva checkpoint directory (h2g output or a training save)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.reader = CheckpointReader(directory)
        self.manifest = self.reader.manifest
        self._module_of: dict[str, str] = {}
        for entry in self.reader.manifest.modules:
            for name in entry.tensors:
                self._module_of[name] = entry.name

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.reader.manifest.model_config_dict)

    def _module(self, tensor: str) -> str | None:
        return self._module_of.get(self.reader.manifest.tied.get(tensor, tensor))

    def info(self, tensor: str) -> TensorInfo | None:
        module = self._module(tensor)
        return (
            None
            if module is None
            else self.reader.module(module).tensors[self.reader.manifest.tied.get(tensor, tensor)]
        )

    def where(self, tensor: str) -> Path:
        module = self._module(tensor)
        return self.directory / (MANIFEST if module is None else self.reader.module(module).file)

    def read_slice(self, tensor: str, index: tuple[slice, ...]) -> torch.Tensor:
        stored = self.reader.manifest.tied.get(tensor, tensor)
        module = self._module(tensor)
        if module is None:
            raise CheckpointError(f"{self.directory / MANIFEST}: tensor {tensor} missing")
        return self.reader.read_slice(module, stored, index)

    def _optimizer_entry(self, tensor: str) -> Any:
        module = self._module(tensor)
        optimizer = self.reader.manifest.optimizer
        if optimizer is None or module is None:
            return None
        return next((e for e in optimizer.modules if e.name == module), None)

    def optimizer_info(self, tensor: str, state: str) -> TensorInfo | None:
        entry = self._optimizer_entry(tensor)
        return None if entry is None else entry.tensors.get(f"{state}/{self.reader.manifest.tied.get(tensor, tensor)}")

    def read_optimizer_slice(self, tensor: str, state: str, index: tuple[slice, ...]) -> torch.Tensor:
        entry = self._optimizer_entry(tensor)
        if entry is None:
            raise CheckpointError(f"{self.directory / MANIFEST}: holds no optimizer state for tensor {tensor}")
        name = f"{state}/{self.reader.manifest.tied.get(tensor, tensor)}"
        if name not in entry.tensors:
            raise CheckpointError(f"{self.directory / entry.file}: tensor {name} missing")
        self.reader.verify(entry.file)
        return read_slice(self.directory / entry.file, name, index)

    def read_rng(self) -> dict[str, torch.Tensor]:
        return self.reader.read_rng()

    def read_side_files(self) -> dict[str, bytes]:
        out = {}
        for name in self.reader.manifest.hf_files:
            self.reader.verify(f"{HF_DIR}/{name}")
            out[name] = (self.directory / HF_DIR / name).read_bytes()
        return out


class HFDirectory(WeightSource):
    """A Hugging Face checkpoint: ``config.json`` and safetensors weights (one file or an index with shards)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.weights = read_hf_weights(directory)
        try:
            self._config = json.loads((directory / CONFIG).read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{directory / CONFIG}: cannot be read ({str(err).splitlines()[0]})") from None

    @property
    def config(self) -> dict[str, Any]:
        return dict(self._config)

    def info(self, tensor: str) -> TensorInfo | None:
        return self.weights.info.get(tensor)

    def where(self, tensor: str) -> Path:
        default = INDEX if (self.directory / INDEX).is_file() else SINGLE
        return self.weights.file_of.get(tensor, self.directory / default)

    def read_slice(self, tensor: str, index: tuple[slice, ...]) -> torch.Tensor:
        if tensor not in self.weights.file_of:
            raise CheckpointError(f"{self.where(tensor)}: tensor {tensor} missing")
        return read_slice(self.weights.file_of[tensor], tensor, index)


def resolve(path: str | os.PathLike[str], warn: bool = True) -> Path:
    """The checkpoint directory ``path`` names: itself, or the newest complete save of a save root."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such directory")
    if (directory / MANIFEST).is_file() or (directory / CONFIG).is_file():
        return directory
    latest = latest_checkpoint(directory, warn=warn)
    if latest is None:
        if any(child.name.startswith("step-") for child in directory.iterdir()):
            raise CheckpointError(f"{directory}: no complete save (every step-* directory lacks its {MANIFEST})")
        raise CheckpointError(f"{directory}: neither a Galva checkpoint ({MANIFEST}) nor a Hugging Face one ({CONFIG})")
    return latest


def resolve_save(path: str | os.PathLike[str], warn: bool = True) -> Path:
    """The Galva checkpoint ``path`` names: a galva-train ``--save`` directory's newest complete save (as ``--load``
    takes it), else ``path`` itself (g2h and info then read or refuse it)."""
    directory = Path(path)
    saves = directory.is_dir() and not (directory / MANIFEST).is_file()
    if saves and any(child.name.startswith("step-") for child in directory.iterdir()):
        return resolve(directory, warn)
    return directory


def open_weights(path: str | os.PathLike[str], warn: bool = True) -> WeightSource:
    """The weights ``path`` names (see the module docstring)."""
    directory = resolve(path, warn)
    if (directory / MANIFEST).is_file():
        return GalvaWeights(directory)
    return HFDirectory(directory)
