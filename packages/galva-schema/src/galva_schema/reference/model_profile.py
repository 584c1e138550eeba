"""Convert between Galva's :class:`~galva_schema.ModelProfile` and the reference system's model profile files.

The reference keeps a model's profile in two processed files (spec §2): ``computation_profiling_{prec}_{name}.json``
and ``memory_profiling_{prec}_{name}.json``. Layer types are numbered ``t = 0, 1, ...`` in model order; the
vocabulary layers (embedding, final norm, head, loss) are "other".

Computation keys (forward ms **per sample**; per layer for layer types):

* ``layertype_{t}_bsz{B}_seq{S}``; older files ``layertype_{t}_bsz{B}`` (no seq) or just ``layertype_{t}`` (a
  static scalar).
* ``layertype_other_bsz{B}_seq{S}`` (``seq[{s0},{s1}]`` for several types); older spellings
  ``layertype_other_0_bsz...`` and the scalar ``layertype_other_0``.
* Raw measurements ``layernum[...]_bsz..`` are skipped; any other key is an error.

``time_mode`` decides the Galva form of ``forward_time``:

* ``static`` → :class:`StaticTime` at the target sequence length. Where several batch sizes were measured the
  largest is used (or ``static_batch_size``), never an arbitrary one (the reference's §11.10).
* ``batch`` → :class:`BatchTime`: least squares of ``value * B`` against ``B``. Galva needs 2 batch sizes; the
  reference requires 8.
* ``sequence`` (one layer type) → :class:`SequenceTime` from the ``bsz1`` entries: a quadratic in the sequence
  length for the layer (3 lengths at least), a line for "other" (2 at least; stored with ``a = 0``).

Memory keys (MiB; suffix ``_sp`` when profiled with Megatron-SP, chosen by ``megatron_sp``; a file with both kinds,
as the reference's own llama_hf profile, is read without ``_sp`` unless ``megatron_sp=True``, as the reference's
search reads it without ``--sequence_parallel``):

* ``layertype_{t}[_sp]`` → ``{seq: {parameter_size, tp_activation_per_bsz_dict: {"1": .., "2": .., "checkpoint": ..}}}``
  → ``parameter_mib``, ``activation_mib_per_sample`` (the tp keys) and ``checkpoint_activation_mib_per_sample``.
* ``other_memory_pp_off|pp_on_first|pp_on_last[_sp]`` → ``{seqinfo: {model_states: {k: ..}, activation: {k: ..}}}``
  → ``vocab.memory_pp_off|memory_pp_first|memory_pp_last`` (``model_states_mib``, ``activation_mib_per_sample``).
  ``seqinfo`` is ``"4096"`` for one type and ``"[512,512]"`` for several.
* The old flat format (no seq level; scalar other memory, read as vocab tp 1; ``other_memory_pp_on`` with
  ``first_stage`` / ``last_stage``) is read too. ``model_config`` and raw ``{pp}_{tp}_{dp}[_c][_vtp][_sp]`` sections
  are skipped.

``memory_mode``:

* ``static``: the entries at the target sequence lengths.
* ``sequence`` (one layer type, as in the reference): ``parameter_size`` and other ``model_states`` from the
  smallest profiled length; activations from the largest, scaled by ``target / largest``. (The reference takes
  other ``model_states`` from an unspecified entry; the smallest is used here, like ``parameter_size``.)

This module reads (the two files' parsers are in :mod:`galva_schema.reference._model_profile_files`); writing is in
:mod:`galva_schema.reference.model_profile_writer`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from galva_schema.errors import SchemaError
from galva_schema.model_profile import LayerTypeProfile, ModelProfile, VocabProfile
from galva_schema.reference._io import PathLike
from galva_schema.reference._model_profile_files import (
    VOCAB_POSITIONS,
    ComputationFile,
    MemoryFile,
    MemoryMode,
    TimeMode,
)
from galva_schema.vocabulary import Precision

_SEQLEN_IN_NAME = re.compile(r"seqlen(\d+)")
_PRECISION_IN_NAME = re.compile(r"(?:computation|memory)_profiling_(bf16|fp16|fp32)_")


def read_galvatron_model_profile(
    computation_path: PathLike,
    memory_path: PathLike,
    *,
    model_name: str,
    num_layers: Sequence[int],
    hidden_sizes: Sequence[int],
    seq_lengths: Sequence[int] | None = None,
    time_mode: TimeMode = "static",
    memory_mode: MemoryMode = "static",
    megatron_sp: bool | None = None,
    precision: Precision | str | None = None,
    static_batch_size: int | None = None,
    layer_type_names: Sequence[str] | None = None,
    vocab_size: int | None = None,
) -> ModelProfile:
    """Read a reference computation + memory profile pair into a validated ModelProfile.

    Args:
        computation_path, memory_path: the processed ``computation_profiling_*`` / ``memory_profiling_*`` files.
        model_name: stored as ``ModelProfile.model_name``.
        num_layers, hidden_sizes: per layer type (the files do not carry them); their length is the number of types.
        seq_lengths: target sequence length per layer type; ``None`` when the files name exactly one per type.
        time_mode, memory_mode: how to read the files, as the reference search's ``time_profile_mode`` /
            ``memory_profile_mode`` (see the module docstring).
        megatron_sp: read the ``_sp`` memory sections (profiled with Megatron-SP); ``None`` picks the only kind
            present, and the plain sections where both are (the reference search's default).
        precision: defaults to the ``bf16``/``fp16``/``fp32`` in the computation file name.
        static_batch_size: in static time mode, the batch size to take when several were measured (default: largest).
        layer_type_names: names of the types (default ``layertype_0``, ...).
        vocab_size: stored in ``vocab.vocab_size``.

    Raises:
        SchemaError: one line naming the file and key, e.g.
        ``memory_profiling_bf16_llama.json: layertype_0.2048.tp_activation_per_bsz_dict.checkpoint: missing``.
    """
    num_types = len(num_layers)
    if num_types == 0:
        raise SchemaError("num_layers: needs one entry per layer type")
    for name, values in (
        ("hidden_sizes", hidden_sizes),
        ("seq_lengths", seq_lengths),
        ("layer_type_names", layer_type_names),
    ):
        if values is not None and len(values) != num_types:
            raise SchemaError(f"{name}: has {len(values)} entries but num_layers has {num_types} layer types")
    if time_mode not in ("static", "batch", "sequence"):
        raise SchemaError(f"time_mode: expected static, batch or sequence, got {time_mode!r}")
    if memory_mode not in ("static", "sequence"):
        raise SchemaError(f"memory_mode: expected static or sequence, got {memory_mode!r}")
    if num_types > 1 and (time_mode == "sequence" or memory_mode == "sequence"):
        raise SchemaError("sequence profile modes support a model with one layer type only (as in the reference)")

    times = ComputationFile(computation_path, num_types)
    memory = MemoryFile(memory_path, num_types, megatron_sp)
    targets = (
        list(seq_lengths)
        if seq_lengths is not None
        else _infer_seq_lengths(times, memory, num_types, (computation_path, memory_path))
    )
    prec = Precision(precision) if precision is not None else _precision_from_names(computation_path, memory_path)

    layer_types = []
    for t in range(num_types):
        parameter, activations, checkpoint = memory.layer(t, targets[t], memory_mode)
        layer_types.append(
            LayerTypeProfile(
                name=layer_type_names[t] if layer_type_names else f"layertype_{t}",
                num_layers=num_layers[t],
                hidden_size=hidden_sizes[t],
                seq_length=targets[t],
                forward_time=times.layer_time(t, targets[t], time_mode, static_batch_size),
                parameter_mib=parameter,
                activation_mib_per_sample=activations,
                checkpoint_activation_mib_per_sample=checkpoint,
            )
        )
    vocab = VocabProfile(
        vocab_size=vocab_size,
        forward_time=times.other_time(tuple(targets), time_mode, static_batch_size),
        **{field: memory.other(position, tuple(targets), memory_mode) for position, field in VOCAB_POSITIONS.items()},
    )
    return ModelProfile(
        model_name=model_name,
        precision=prec,
        megatron_sp=memory.megatron_sp,
        layer_types=tuple(layer_types),
        vocab=vocab,
    )


def galvatron_model_profile_file_names(model_name: str, precision: Precision | str) -> tuple[str, str]:
    """``(computation_profiling_{prec}_{name}.json, memory_profiling_{prec}_{name}.json)``."""
    prec = Precision(precision).value
    return f"computation_profiling_{prec}_{model_name}.json", f"memory_profiling_{prec}_{model_name}.json"


def _infer_seq_lengths(
    times: ComputationFile, memory: MemoryFile, num_types: int, paths: tuple[PathLike, PathLike]
) -> list[int]:
    """The one sequence length each type was profiled at; old files only say it in their name (``_seqlen2048``)."""
    out = []
    for t in range(num_types):
        seqs = times.seqs(t) | memory.seqs(t)
        if not seqs and num_types == 1:
            seqs = {int(m[1]) for path in paths if (m := _SEQLEN_IN_NAME.search(Path(path).name))}
        if len(seqs) != 1:
            found = ", ".join(map(str, sorted(seqs))) or "none"
            raise SchemaError(
                f"seq_lengths: layertype_{t} is profiled at {len(seqs)} sequence lengths ({found}); pass seq_lengths"
            )
        out.append(seqs.pop())
    return out


def _precision_from_names(*paths: PathLike) -> Precision:
    for path in paths:
        match = _PRECISION_IN_NAME.match(Path(path).name)
        if match:
            return Precision(match[1])
    raise SchemaError(f"precision: neither file name ({Path(paths[0]).name}) says bf16, fp16 or fp32; pass precision=")


__all__ = [
    "MemoryMode",
    "TimeMode",
    "galvatron_model_profile_file_names",
    "read_galvatron_model_profile",
]
