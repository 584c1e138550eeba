"""Loading the hardware and model profiles the search consumes: Galva files, or the reference system's files
through galva_schema.reference's explicit converters. Every problem is a one-line SchemaError naming the file."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from galva_schema import HardwareProfile, ModelProfile, SchemaError


def load_hardware(
    path: str | os.PathLike[str], *, num_nodes: int | None = None, gpus_per_node: int | None = None
) -> HardwareProfile:
    """A Galva hardware-profile JSON file, or a directory of the reference's hardware files (``num_nodes`` and
    ``gpus_per_node`` then name which files to read; both are required)."""
    path = Path(path)
    if path.is_dir():
        if num_nodes is None or gpus_per_node is None:
            raise SchemaError(
                "a directory of reference hardware files needs --nodes and --gpus-per-node to pick the files",
                source=str(path),
            )
        from galva_schema.reference import read_galvatron_hardware

        return read_galvatron_hardware(path, num_nodes=num_nodes, gpus_per_node=gpus_per_node)
    return HardwareProfile.load(path)


def load_model(
    paths: Sequence[str | os.PathLike[str]],
    *,
    num_layers: Sequence[int] | None = None,
    hidden_sizes: Sequence[int] | None = None,
    seq_lengths: Sequence[int] | None = None,
    model_name: str | None = None,
    time_mode: Literal["static", "batch", "sequence"] = "static",
    memory_mode: Literal["static", "sequence"] = "static",
    megatron_sp: bool | None = None,
) -> ModelProfile:
    """One Galva model-profile file, or two reference files (computation, then memory) with the layer counts and
    hidden sizes per layer type that those files do not carry."""
    if len(paths) == 1:
        profile = ModelProfile.load(paths[0])
        _check_flags_agree(profile, paths[0], num_layers, hidden_sizes, seq_lengths, model_name)
        return profile
    if len(paths) != 2:
        raise SchemaError(f"--model-profile: give one Galva file or two reference files, got {len(paths)}")
    computation, memory = (Path(p) for p in paths)
    if not num_layers or not hidden_sizes:
        raise SchemaError(
            "reading reference model files needs --num-layers and --hidden-size (one value per layer type)",
            source=str(computation),
        )
    _check_names_agree(computation, memory, hidden_sizes, seq_lengths)

    try:
        return _read_reference(
            computation, memory, num_layers, hidden_sizes, seq_lengths, model_name, time_mode, memory_mode, megatron_sp
        )
    except SchemaError as err:  # the reader names its arguments; a user typed flags
        message = str(err)
        for argument, flag in _FLAG_NAMES.items():
            message = message.replace(f"{argument}:", f"{flag}:").replace(f"{argument} has", f"{flag} has")
        raise SchemaError(message) from None


_FLAG_NAMES = {"num_layers": "--num-layers", "hidden_sizes": "--hidden-size", "seq_lengths": "--seq-length"}


def _check_flags_agree(
    profile: ModelProfile,
    path: str | os.PathLike[str],
    num_layers: Sequence[int] | None,
    hidden_sizes: Sequence[int] | None,
    seq_lengths: Sequence[int] | None,
    model_name: str | None,
) -> None:
    """A Galva profile carries what the reference-file flags say; a flag that contradicts it would plan one model
    with another's numbers (or be ignored): refuse it, naming the flag and the profile's value."""
    types = profile.layer_types
    facts = [
        ("--num-layers", num_layers, [t.num_layers for t in types], "{} layers"),
        ("--hidden-size", hidden_sizes, [t.hidden_size for t in types], "hidden size {}"),
        ("--seq-length", seq_lengths, [t.seq_length for t in types], "sequence length {}"),
    ]
    for flag, given, held, what in facts:
        if given and list(given) != held:
            text = ",".join(map(str, given))
            raise SchemaError(
                f"{flag} {text}: the model profile ({profile.model_name}) has {what.format(','.join(map(str, held)))} "
                f"(per layer type), not {text}; drop the flag (it is for reference files) or give this model's profile",
                source=str(path),
            )
    if model_name is not None and model_name != profile.model_name:
        raise SchemaError(
            f"--model-name {model_name!r} contradicts the model profile's model_name {profile.model_name!r}",
            source=str(path),
        )
_NAME_FACTS = {"hidden": ("--hidden-size", "hidden size"), "seqlen": ("--seq-length", "sequence length")}


def _check_names_agree(
    computation: Path, memory: Path, hidden_sizes: Sequence[int], seq_lengths: Sequence[int] | None
) -> None:
    """The reference names its files after the model (``..._hidden4096_head32_seqlen2048.json``); a ``--hidden-size``
    or ``--seq-length`` that the name contradicts plans for another model than the one profiled: refuse it."""
    given = {"hidden": list(hidden_sizes), "seqlen": list(seq_lengths or [])}
    for path in (computation, memory):
        for key, (flag, what) in _NAME_FACTS.items():
            match = re.search(rf"_{key}(\d+)(?=[_.])", path.name)
            if match is None or not given[key]:
                continue
            named = int(match.group(1))
            if named not in given[key]:
                values = ",".join(map(str, given[key]))
                raise SchemaError(
                    f"the file name says {what} {named}, but {flag} is {values}; give the {what} it was profiled with",
                    source=str(path),
                )


def _read_reference(
    computation: Path,
    memory: Path,
    num_layers: Sequence[int],
    hidden_sizes: Sequence[int],
    seq_lengths: Sequence[int] | None,
    model_name: str | None,
    time_mode: Literal["static", "batch", "sequence"],
    memory_mode: Literal["static", "sequence"],
    megatron_sp: bool | None,
) -> ModelProfile:
    from galva_schema.reference import read_galvatron_model_profile

    return read_galvatron_model_profile(
        computation,
        memory,
        model_name=model_name or computation.stem.removeprefix("computation_profiling_"),
        num_layers=list(num_layers),
        hidden_sizes=list(hidden_sizes),
        seq_lengths=list(seq_lengths) if seq_lengths else None,
        time_mode=time_mode,
        memory_mode=memory_mode,
        megatron_sp=megatron_sp,
    )


_UNITS = {
    "b": 1.0 / 2**20,
    "kb": 1e3 / 2**20,
    "mb": 1e6 / 2**20,
    "gb": 1e9 / 2**20,
    "tb": 1e12 / 2**20,
    "kib": 1.0 / 1024,
    "mib": 1.0,
    "gib": 1024.0,
    "tib": 1024.0 * 1024.0,
}


def parse_memory(text: str, *, allow_zero: bool = False) -> float:
    """``"36GB"`` (1e9 bytes), ``"36GiB"`` (2**30 bytes), ``"36000MiB"``, ... -> MiB. A unit is required, except
    for a plain ``0`` where ``allow_zero`` (reserves and overheads may be zero; budgets may not)."""
    raw = text.strip().replace(" ", "")
    if allow_zero and raw == "0":
        return 0.0
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = raw[len(number) :].lower()
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"memory {text!r}: expected a number with a unit, e.g. 36GB, 36GiB or 36000MiB") from None
    if unit not in _UNITS:
        raise ValueError(
            f"memory {text!r}: unknown or missing unit {unit!r}; use B, KB, MB, GB, TB (powers of 10) or KiB, MiB, "
            f"GiB, TiB (powers of 2)"
        )
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"memory {text!r}: must be {'zero or ' if allow_zero else ''}positive")
    return value * _UNITS[unit]
