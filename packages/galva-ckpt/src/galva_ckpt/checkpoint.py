"""The library API of the layerwise format: :class:`CheckpointWriter` and :class:`CheckpointReader`.

Writing (h2g here; galva-train's saves through :func:`galva_ckpt.sharded.save_sharded`)::

    with atomic_directory(out, force=False) as tmp:
        writer = CheckpointWriter(tmp)
        writer.write_module("embedding", {"model.embed_tokens.weight": tensor})
        ...                                      # every module, one at a time
        writer.finish(family="llama", config=config_dict, num_layers=4)

Reading (g2h here; galva-train's loads later): ``CheckpointReader(dir)`` checks the manifest, then
:meth:`~CheckpointReader.read_module` returns one module's full tensors (checksum verified first) and
:meth:`~CheckpointReader.read_slice` one slice of one tensor without reading the rest.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from galva_ckpt.errors import CheckpointError
from galva_ckpt.format import HF_DIR, MANIFEST, RNG_FILE, module_file, optimizer_file
from galva_ckpt.reading import iter_tensors, read_header, read_slice, verify_file
from galva_ckpt.writing import copy_file, tensor_infos, write_bytes, write_safetensors
from galva_schema import SchemaError
from galva_schema.checkpoint import CheckpointManifest, FileInfo, ModuleEntry, OptimizerState, TensorInfo

__all__ = ["CheckpointReader", "CheckpointWriter"]


class CheckpointWriter:
    """Writes the files of one checkpoint directory (already a temporary one), then the manifest last."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.modules: list[ModuleEntry] = []
        self.optimizer_modules: list[ModuleEntry] = []
        self.files: dict[str, FileInfo] = {}
        self.hf_files: list[str] = []
        self.rng_file: str | None = None

    def write_module(self, name: str, tensors: Mapping[str, torch.Tensor]) -> ModuleEntry:
        """Write one module's full tensors (Hugging Face on-disk names) to ``model/<name>.safetensors``."""
        return self.stream_module(name, tensor_infos(tensors), tensors.values())

    def stream_module(
        self,
        name: str,
        infos: Mapping[str, TensorInfo],
        tensors: Iterable[torch.Tensor],
        on_tensor: Callable[[int], None] | None = None,
    ) -> ModuleEntry:
        """Like :meth:`write_module`, with the tensors arriving one by one in the order of ``infos``."""
        entry = self._write(module_file(name), name, infos, tensors, on_tensor)
        self.modules.append(entry)
        return entry

    def write_optimizer_module(self, name: str, states: Mapping[str, torch.Tensor]) -> ModuleEntry:
        """Write one module's optimizer state, tensors named ``<state>/<hf name>``, full and unsharded."""
        entry = self._write(optimizer_file(name), name, tensor_infos(states), states.values(), None)
        self.optimizer_modules.append(entry)
        return entry

    def write_rng(self, states: Mapping[str, torch.Tensor]) -> None:
        """Write RNG states (uint8 tensors such as ``rank0/cpu`` from ``torch.get_rng_state()``)."""
        self._write(RNG_FILE, "rng", tensor_infos(states), states.values(), None)
        self.rng_file = RNG_FILE

    def copy_hf_file(self, source: Path) -> None:
        """Keep a Hugging Face side file (tokenizer, generation config) verbatim under ``hf/``."""
        relative = f"{HF_DIR}/{source.name}"
        self.files[relative] = copy_file(source, self.directory / relative)
        self.hf_files.append(source.name)

    def write_hf_file(self, name: str, data: bytes) -> None:
        """Keep a Hugging Face side file given by its bytes (a training run reads its tokenizer once, at the start:
        the directory it came from may be pruned or edited before a later save)."""
        relative = f"{HF_DIR}/{name}"
        self.files[relative] = write_bytes(self.directory / relative, data)
        self.hf_files.append(name)

    def finish(
        self,
        *,
        family: str,
        config: Mapping[str, Any],
        num_layers: int,
        tied: Mapping[str, str] | None = None,
        step: int | None = None,
        optimizer: Mapping[str, Any] | None = None,
        scheduler: Mapping[str, Any] | None = None,
        data_position: Mapping[str, Any] | None = None,
        mixed_precision: str | None = None,
    ) -> CheckpointManifest:
        """Write ``manifest.json`` (validated) and return it. ``optimizer``: OptimizerState fields but modules;
        ``mixed_precision``: the training run's compute precision."""
        optimizer_state = None
        if optimizer is not None:
            optimizer_state = OptimizerState(**dict(optimizer), modules=tuple(self.optimizer_modules))
        manifest = CheckpointManifest(
            model_family=family,
            model_config=dict(config),  # type: ignore[call-arg]  # the field's JSON alias
            num_layers=num_layers,
            modules=tuple(self.modules),
            step=step,
            has_optimizer_state=optimizer_state is not None,
            tied=dict(tied or {}),
            files=dict(self.files),
            hf_files=tuple(self.hf_files),
            optimizer=optimizer_state,
            scheduler=None if scheduler is None else dict(scheduler),
            data_position=None if data_position is None else dict(data_position),
            mixed_precision=mixed_precision,
            rng_file=self.rng_file,
        )
        manifest.save(self.directory / MANIFEST)
        return manifest

    def _write(
        self,
        relative: str,
        name: str,
        infos: Mapping[str, TensorInfo],
        tensors: Iterable[torch.Tensor],
        on_tensor: Callable[[int], None] | None,
    ) -> ModuleEntry:
        metadata = {"format": "pt", "galva_module": name}
        self.files[relative] = write_safetensors(self.directory / relative, infos, tensors, metadata, on_tensor)
        return ModuleEntry(name=name, file=relative, tensors=dict(infos))


class CheckpointReader:
    """Reads a checkpoint directory module by module; every file is checked against the manifest before use."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (not a Galva checkpoint directory?)")
        try:
            self.manifest = CheckpointManifest.load(path)
        except SchemaError as err:
            raise CheckpointError(str(err).splitlines()[0]) from None
        self._checked: set[str] = set()

    @property
    def module_names(self) -> list[str]:
        return [m.name for m in self.manifest.modules]

    def module(self, name: str) -> ModuleEntry:
        """The manifest entry of a model module."""
        return _entry(self.manifest.modules, name, self.directory / MANIFEST)

    def verify(self, relative: str) -> None:
        """Check one file's size and sha256 against the manifest (once per reader)."""
        if relative not in self._checked:
            verify_file(self.directory, relative, self.manifest.files.get(relative))
            self._checked.add(relative)

    def verify_all(self) -> list[str]:
        """Check every file the manifest lists; returns their relative paths."""
        for relative in self.manifest.files:
            self.verify(relative)
        return list(self.manifest.files)

    def iter_module(self, name: str, optimizer: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield one module's tensors one at a time, after verifying its file and its header."""
        entry = self._entry(name, optimizer)
        path = self.check_header(name, optimizer)
        yield from iter_tensors(path, entry.tensors)

    def check_header(self, name: str, optimizer: bool = False) -> Path:
        """Verify one module's file, then read its safetensors header (no tensor data): it must parse and list exactly
        the manifest's tensors with their shapes and dtypes. Returns the file's path; CheckpointError otherwise."""
        entry = self._entry(name, optimizer)
        self.verify(entry.file)
        path = self.directory / entry.file
        header = read_header(path)
        for tensor_name, info in entry.tensors.items():
            found = header.get(tensor_name)
            if found is None:
                raise CheckpointError(f"{path}: tensor {tensor_name} missing")
            if found != info:
                raise CheckpointError(
                    f"{path}: tensor {tensor_name} is {_describe(found)}, manifest says {_describe(info)}"
                )
        extra = sorted(set(header) - set(entry.tensors))
        if extra:
            raise CheckpointError(f"{path}: tensor {extra[0]} is not in the manifest")
        return path

    def read_module(self, name: str, optimizer: bool = False) -> dict[str, torch.Tensor]:
        """One module's full tensors (``optimizer=True``: its optimizer state)."""
        return dict(self.iter_module(name, optimizer))

    def read_slice(self, module: str, tensor: str, index: tuple[slice | int, ...]) -> torch.Tensor:
        """``tensor[index]`` of one module's file, reading only that slice (checksum verified once per reader)."""
        entry = self.module(module)
        if tensor not in entry.tensors:
            raise CheckpointError(f"{self.directory / entry.file}: tensor {tensor} is not in the manifest")
        self.verify(entry.file)
        return read_slice(self.directory / entry.file, tensor, index)

    def module_of(self, tensor: str) -> str:
        """Which module stores a Hugging Face name (tied aliases resolve to the stored tensor)."""
        stored = self.manifest.tied.get(tensor, tensor)
        for entry in self.manifest.modules:
            if stored in entry.tensors:
                return entry.name
        raise CheckpointError(f"{self.directory / MANIFEST}: no module stores tensor {tensor}")

    def read_rng(self) -> dict[str, torch.Tensor]:
        """The saved RNG states (empty when none were saved)."""
        if self.manifest.rng_file is None:
            return {}
        self.verify(self.manifest.rng_file)
        return dict(iter_tensors(self.directory / self.manifest.rng_file))

    def _entry(self, name: str, optimizer: bool) -> ModuleEntry:
        if not optimizer:
            return self.module(name)
        if self.manifest.optimizer is None:
            raise CheckpointError(f"{self.directory / MANIFEST}: holds no optimizer state")
        return _entry(self.manifest.optimizer.modules, name, self.directory / MANIFEST)


def _entry(entries: tuple[ModuleEntry, ...], name: str, source: Path) -> ModuleEntry:
    for entry in entries:
        if entry.name == name:
            return entry
    raise CheckpointError(f"{source}: no module {name!r}")


def _describe(info: TensorInfo) -> str:
    return f"{list(info.shape)} {info.dtype}"
