"""``galva-ckpt info``: what a checkpoint holds, and whether every file matches its checksum and can be read."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from galva_ckpt.checkpoint import CheckpointReader
from galva_ckpt.reading import read_header
from galva_ckpt.sources import resolve_save

__all__ = ["describe"]


def describe(directory: str | Path, verify: bool = True) -> str:
    """A human-readable summary; with ``verify`` every file is checked first (CheckpointError on a mismatch): its
    checksum, and for model and optimizer modules the safetensors header against the manifest. ``directory`` is a
    checkpoint or a galva-train ``--save`` directory (its newest complete save, as ``--load`` takes it)."""
    reader = CheckpointReader(resolve_save(directory))
    checked = reader.verify_all() if verify else []
    m = reader.manifest
    headers = 0
    if verify:  # a file whose checksum matches can still have a header no reader parses
        for entry in m.modules:
            reader.check_header(entry.name)
        for entry in m.optimizer.modules if m.optimizer is not None else ():
            reader.check_header(entry.name, optimizer=True)
        headers = len(m.modules) + (len(m.optimizer.modules) if m.optimizer is not None else 0)
        if m.rng_file is not None:
            read_header(reader.directory / m.rng_file)
            headers += 1
    dtypes: Counter[str] = Counter()
    for entry in m.modules:
        for info in entry.tensors.values():
            dtypes[info.dtype] += 1
    weight_bytes = sum(m.files[e.file].size for e in m.modules if e.file in m.files)
    lines = [
        f"checkpoint   {reader.directory}",
        f"format       {m.kind} v{m.schema_version}",
        f"model        {m.model_family} (model_type {m.model_config_dict.get('model_type')!r}), {m.num_layers} layers",
        f"step         {m.step if m.step is not None else '-'}",
        f"dtypes       {', '.join(f'{d} x{n}' for d, n in sorted(dtypes.items()))}",
        f"weights      {len(m.modules)} module files, {sum(len(e.tensors) for e in m.modules)} tensors, "
        f"{weight_bytes / 2**20:.2f} MiB",
    ]
    lines += [f"  {e.name:<12} {len(e.tensors):>4} tensors  {e.file}" for e in m.modules]
    lines += [f"tied         {alias} -> {target}" for alias, target in m.tied.items()]
    if m.optimizer is not None:
        o = m.optimizer
        lines.append(f"optimizer    {o.kind} step {o.step}, states {', '.join(o.state_names)}, {len(o.modules)} files")
    else:
        lines.append("optimizer    -")
    lines.append(f"scheduler    {m.scheduler if m.scheduler is not None else '-'}")
    lines.append(f"data         {m.data_position if m.data_position is not None else '-'}")
    lines.append(f"rng          {m.rng_file or '-'}")
    lines.append(f"hf files     {', '.join(m.hf_files) if m.hf_files else '-'}")
    lines.append(
        f"checksums    {len(checked)} files OK (sha256), {headers} safetensors headers read"
        if verify
        else "checksums    not verified"
    )
    return "\n".join(lines)
