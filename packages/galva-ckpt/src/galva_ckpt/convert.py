"""Hugging Face <-> Galva conversion (``h2g``, ``g2h``), streaming one module at a time.

Both directions first check everything that can be checked from headers and the config (every tensor present,
known to the model, with the config's shape), so a wrong input fails before any output exists. Then tensors flow
one by one from the source files to the output files, the source file of a module being closed before the next
module starts. Output goes to ``<out>.tmp-<random>`` and is renamed to ``<out>`` only when complete.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator, Sequence
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import torch

from galva_ckpt.checkpoint import CheckpointReader, CheckpointWriter
from galva_ckpt.errors import CheckpointError
from galva_ckpt.format import HF_DIR, MANIFEST
from galva_ckpt.hf import CONFIG, INDEX, SINGLE, HFWeights, plan_shards, read_hf_weights, shard_name, side_files
from galva_ckpt.layout import ModelLayout, model_layout
from galva_ckpt.progress import progress_bar
from galva_ckpt.reading import open_safetensors
from galva_ckpt.sources import resolve_save
from galva_ckpt.writing import atomic_directory, copy_file, write_safetensors
from galva_schema import SchemaError, write_json_atomic
from galva_schema._base import load_json_object
from galva_schema.checkpoint import CheckpointManifest, TensorInfo
from galva_schema.interrupt import raise_if_interrupted
from galva_schema.vocabulary import layer_of_module

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "galva_to_hf", "hf_to_galva"]

DEFAULT_MAX_SHARD_SIZE = 50 * 10**9
"""transformers' own default for ``save_pretrained`` (\"50GB\")."""


def hf_to_galva(
    hf_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, force: bool = False, progress: bool = True
) -> CheckpointManifest:
    """Convert a Hugging Face safetensors checkpoint directory into a Galva checkpoint directory."""
    source, target = Path(hf_dir), Path(out_dir)
    _check_distinct(source, target)
    config_path = source / CONFIG
    config = _load_config(config_path)
    layout = model_layout(config, str(config_path))
    weights = read_hf_weights(source)
    _check_hf_tensors(weights, layout, config_path)
    total = sum(_nbytes(weights.info[n]) for m in layout.modules for n in m.shapes)
    with atomic_directory(target, force) as tmp, progress_bar(total, "h2g", progress) as advance:
        writer = CheckpointWriter(tmp)
        for module in layout.modules:
            infos = {name: weights.info[name] for name in module.shapes}
            # closed here, not when collected: a Ctrl-C while a suspended reader's files close must reach this frame
            with closing(_read_hf_tensors(weights, list(infos))) as tensors:
                writer.stream_module(module.name, infos, tensors, advance)
        for path in side_files(source):
            writer.copy_hf_file(path)
        layers = sum(layer_of_module(m.name) is not None for m in layout.modules)
        return writer.finish(family=layout.family, config=config, num_layers=layers, tied=layout.tied)


def galva_to_hf(
    galva_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    progress: bool = True,
) -> list[str]:
    """Convert a Galva checkpoint into a Hugging Face directory ``from_pretrained`` loads; returns its file names.

    ``galva_dir`` is a checkpoint or a galva-train ``--save`` directory (its newest complete save, as ``--load``
    takes it). The side files it keeps (the tokenizer of h2g's source or of the training run) are written back.
    """
    source, target = resolve_save(galva_dir), Path(out_dir)
    _check_distinct(source, target)
    reader = CheckpointReader(source)
    manifest = reader.manifest
    layout = model_layout(manifest.model_config_dict, str(source / MANIFEST))
    _check_manifest(reader, layout)
    sizes = [(name, _nbytes(info)) for m in manifest.modules for name, info in m.tensors.items()]
    infos = {name: info for m in manifest.modules for name, info in m.tensors.items()}
    shards = plan_shards(sizes, max_shard_size)
    with atomic_directory(target, force) as tmp, progress_bar(sum(s for _, s in sizes), "g2h", progress) as advance:
        write_json_atomic(tmp / CONFIG, manifest.model_config_dict)
        for name in manifest.hf_files:
            relative = f"{HF_DIR}/{name}"
            reader.verify(relative)
            copy_file(source / relative, tmp / name)
        weight_map: dict[str, str] = {}
        with closing(_galva_tensors(reader)) as stream:  # closed here, as h2g's readers
            for i, names in enumerate(shards):
                file = shard_name(i, len(shards))
                write_safetensors(
                    tmp / file, {n: infos[n] for n in names}, _take(stream, names), {"format": "pt"}, advance
                )
                weight_map.update(dict.fromkeys(names, file))
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(s for _, s in sizes)}, "weight_map": weight_map}
            write_json_atomic(tmp / INDEX, index)
    return sorted(p.name for p in target.iterdir())


def _check_distinct(source: Path, target: Path) -> None:
    src, out = source.resolve(), target.resolve()
    if out == src or src in out.parents or out in src.parents:
        raise CheckpointError(f"{target}: the output must not be, contain or lie inside the input {source}")


def _load_config(path: Path) -> dict[str, Any]:
    try:
        return load_json_object(path)
    except SchemaError as err:
        raise CheckpointError(str(err).splitlines()[0]) from None


def _check_hf_tensors(weights: HFWeights, layout: ModelLayout, config_path: Path) -> None:
    """Every tensor the config implies is present with its shape, and every tensor present is one of them."""
    expected = {name: shape for m in layout.modules for name, shape in m.shapes.items()}
    for name, info in weights.info.items():
        file = weights.file_of[name]
        shape = expected.get(name)
        if shape is None and name in layout.tied:
            shape = expected[layout.tied[name]]  # a tied alias saved anyway: dropped, Hugging Face re-ties it
        if shape is None:
            raise CheckpointError(
                f"{file}: tensor {name} is not part of the {layout.family} model {config_path} describes "
                "(a checkpoint of another model?)"
            )
        if info.shape != shape:
            raise CheckpointError(
                f"{file}: tensor {name} has shape {list(info.shape)}, {config_path} implies {list(shape)}"
            )
    where = weights.directory / (INDEX if (weights.directory / INDEX).is_file() else SINGLE)
    for module in layout.modules:
        for name in module.shapes:
            if name not in weights.info:
                raise CheckpointError(f"{where}: tensor {name} missing (module {module.name} of {config_path})")


def _read_hf_tensors(weights: HFWeights, names: Sequence[str]) -> Generator[torch.Tensor, None, None]:
    """One module's tensors in order, from the source files it needs (opened for this module only)."""
    with ExitStack() as stack:
        handles = {path: stack.enter_context(open_safetensors(path)) for path in {weights.file_of[n] for n in names}}
        for name in names:
            path = weights.file_of[name]
            try:
                yield handles[path].get_tensor(name)
            except Exception as err:  # safetensors raises its own error type for damaged data
                raise_if_interrupted()  # Ctrl-C inside the read surfaces as the reader's own error
                raise CheckpointError(f"{path}: tensor {name}: cannot be read ({err})") from None


_FORMER_FAMILIES = {"llama": ("llama", "mistral", "qwen2")}
"""A manifest's family name from before these families ran from their tables -> the families it stands for."""


def _check_manifest(reader: CheckpointReader, layout: ModelLayout) -> None:
    """The manifest's modules and shapes are those its own config implies (a hand-edited or foreign manifest)."""
    manifest, where = reader.manifest, reader.directory / MANIFEST
    if manifest.model_family != layout.family and layout.family not in _FORMER_FAMILIES.get(manifest.model_family, ()):
        raise CheckpointError(f"{where}: model_family {manifest.model_family!r} but the config is a {layout.family}")
    wanted = [m.name for m in layout.modules]
    if [m.name for m in manifest.modules] != wanted:
        raise CheckpointError(f"{where}: modules {[m.name for m in manifest.modules]} but the config implies {wanted}")
    for module, entry in zip(layout.modules, manifest.modules):
        file = reader.directory / entry.file
        for name, shape in module.shapes.items():
            info = entry.tensors.get(name)
            if info is None:
                raise CheckpointError(f"{file}: tensor {name} missing from the manifest (the config implies it)")
            if info.shape != shape:
                raise CheckpointError(
                    f"{file}: tensor {name} has shape {list(info.shape)}, the config implies {list(shape)}"
                )
        extra = sorted(set(entry.tensors) - set(module.shapes))
        if extra:
            raise CheckpointError(f"{file}: tensor {extra[0]} is not part of the {layout.family} model of the config")
    if dict(manifest.tied) != dict(layout.tied):
        raise CheckpointError(f"{where}: tied {manifest.tied} but the config implies {dict(layout.tied)}")


def _galva_tensors(reader: CheckpointReader) -> Generator[tuple[str, torch.Tensor], None, None]:
    for entry in reader.manifest.modules:
        yield from reader.iter_module(entry.name)


def _take(stream: Iterator[tuple[str, torch.Tensor]], names: Sequence[str]) -> Iterator[torch.Tensor]:
    for expected in names:
        name, tensor = next(stream)
        if name != expected:  # the shard plan and the stream follow the same manifest order
            raise CheckpointError(f"internal error: expected tensor {expected}, read {name}")
        yield tensor


def _nbytes(info: TensorInfo) -> int:
    count = 1
    for dim in info.shape:
        count *= dim
    return count * getattr(torch, info.dtype).itemsize
