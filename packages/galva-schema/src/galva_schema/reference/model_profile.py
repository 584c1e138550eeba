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

Writing produces the processed form at the profile's sequence lengths: one entry per sequence length in the memory
file, and for the computation file the profile's own form (a static value, ``batch_sizes`` points of a batch fit, or
``sequence_lengths`` points of a sequence fit), so the reference search reads it back in the same mode.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from galva_schema.errors import SchemaError
from galva_schema.files import write_json_atomic
from galva_schema.model_profile import (
    BatchTime,
    LayerTypeProfile,
    ModelProfile,
    SequenceTime,
    StaticTime,
    VocabMemory,
    VocabProfile,
)
from galva_schema.reference._io import PathLike, integer, load_json_object, number
from galva_schema.reference.fitting import polyfit
from galva_schema.vocabulary import Precision

TimeMode = Literal["static", "batch", "sequence"]
MemoryMode = Literal["static", "sequence"]

_SEQINFO = r"(\d+|\[\s*\d+(?:\s*,\s*\d+)*\s*\])"
_LAYER_TIME = re.compile(r"layertype_(\d+)(?:_bsz(\d+))?(?:_seq(\d+))?")
_OTHER_TIME = re.compile(r"layertype_other(?:_(\d+))?(?:_bsz(\d+))?(?:_seq" + _SEQINFO + r")?")
_RAW_TIME = re.compile(r"layernum\[.*")
_LAYER_MEMORY = re.compile(r"layertype_(\d+)(_sp)?")
_OTHER_MEMORY = re.compile(r"other_memory_pp_(off|on_first|on_last|on)(_sp)?")
_RAW_MEMORY = re.compile(r"\d+_\d+_\d+(?:_c)?(?:_vtp)?(?:_sp)?")
_SEQLEN_IN_NAME = re.compile(r"seqlen(\d+)")
_PRECISION_IN_NAME = re.compile(r"(?:computation|memory)_profiling_(bf16|fp16|fp32)_")
_POSITIONS = {"off": "memory_pp_off", "on_first": "memory_pp_first", "on_last": "memory_pp_last"}


@dataclass(frozen=True)
class _TimePoint:
    batch: int | None
    seq: tuple[int, ...] | None
    value: float
    key: str


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

    times = _ComputationFile(computation_path, num_types)
    memory = _MemoryFile(memory_path, num_types, megatron_sp)
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
        **{field: memory.other(position, tuple(targets), memory_mode) for position, field in _POSITIONS.items()},
    )
    return ModelProfile(
        model_name=model_name,
        precision=prec,
        megatron_sp=memory.megatron_sp,
        layer_types=tuple(layer_types),
        vocab=vocab,
    )


def to_galvatron_model_profile(
    profile: ModelProfile,
    *,
    batch_sizes: Iterable[int] = range(1, 9),
    sequence_lengths: Iterable[int] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reference ``(computation, memory)`` dicts for ``profile``.

    Args:
        batch_sizes: where a :class:`BatchTime` is sampled (the reference search needs at least 8).
        sequence_lengths: where a :class:`SequenceTime` is sampled, at batch size 1; default: eight lengths from a
            quarter of the profile's length to twice it.
    """
    batches = sorted(set(batch_sizes))
    seqs = sorted(set(sequence_lengths)) if sequence_lengths is not None else None
    computation: dict[str, Any] = {}
    for t, layer_type in enumerate(profile.layer_types):
        for batch, seq, value in _samples(layer_type.forward_time, layer_type.seq_length, batches, seqs):
            computation[f"layertype_{t}_bsz{batch}_seq{seq}"] = value
    targets = profile.sequence_lengths
    for batch, seq, value in _samples(profile.vocab.forward_time, targets[0], batches, seqs):
        info = f"seq{seq}" if len(targets) == 1 else f"seq[{','.join(map(str, targets))}]"
        computation[f"layertype_other_bsz{batch}_{info}"] = value

    suffix = "_sp" if profile.megatron_sp else ""
    memory: dict[str, Any] = {}
    for t, layer_type in enumerate(profile.layer_types):
        activations: dict[str, float] = {
            str(tp): value for tp, value in sorted(layer_type.activation_mib_per_sample.items())
        }
        activations["checkpoint"] = layer_type.checkpoint_activation_mib_per_sample
        memory[f"layertype_{t}{suffix}"] = {
            str(layer_type.seq_length): {
                "parameter_size": layer_type.parameter_mib,
                "tp_activation_per_bsz_dict": activations,
            }
        }
    seqinfo = str(targets[0]) if len(targets) == 1 else f"[{','.join(map(str, targets))}]"
    for position, field in _POSITIONS.items():
        part: VocabMemory = getattr(profile.vocab, field)
        memory[f"other_memory_pp_{position}{suffix}"] = {
            seqinfo: {
                "model_states": {str(k): v for k, v in sorted(part.model_states_mib.items())},
                "activation": {str(k): v for k, v in sorted(part.activation_mib_per_sample.items())},
            }
        }
    return computation, memory


def write_galvatron_model_profile(
    profile: ModelProfile,
    computation_path: PathLike,
    memory_path: PathLike,
    *,
    batch_sizes: Iterable[int] = range(1, 9),
    sequence_lengths: Iterable[int] | None = None,
) -> tuple[Path, Path]:
    """Write the reference computation and memory files of ``profile`` (each atomically); returns both paths."""
    computation, memory = to_galvatron_model_profile(
        profile, batch_sizes=batch_sizes, sequence_lengths=sequence_lengths
    )
    return write_json_atomic(computation_path, computation), write_json_atomic(memory_path, memory)


def galvatron_model_profile_file_names(model_name: str, precision: Precision | str) -> tuple[str, str]:
    """``(computation_profiling_{prec}_{name}.json, memory_profiling_{prec}_{name}.json)``."""
    prec = Precision(precision).value
    return f"computation_profiling_{prec}_{model_name}.json", f"memory_profiling_{prec}_{model_name}.json"


# --------------------------------------------------------------------------------------------------- computation
class _ComputationFile:
    def __init__(self, path: PathLike, num_types: int) -> None:
        self.source = str(path)
        data = load_json_object(path)
        self.layers: list[list[_TimePoint]] = [[] for _ in range(num_types)]
        self.other: list[_TimePoint] = []
        for key, value in data.items():
            if _RAW_TIME.fullmatch(key):
                continue
            layer, other = _LAYER_TIME.fullmatch(key), _OTHER_TIME.fullmatch(key)
            if layer:
                t = int(layer[1])
                if t >= num_types:
                    raise self.error(f"{key}: layer type {t} but num_layers lists {num_types} type(s)")
                seq: tuple[int, ...] | None = (int(layer[3]),) if layer[3] else None
                self.layers[t].append(_TimePoint(_opt_int(layer[2]), seq, self.value(key, value), key))
            elif other:
                if other[1] not in (None, "0"):
                    continue  # old files repeat "other" once per layer type; only entry 0 is meaningful
                seq = _parse_seqinfo(other[3]) if other[3] else None
                self.other.append(_TimePoint(_opt_int(other[2]), seq, self.value(key, value), key))
            else:
                expected = "layertype_{t}_bsz{B}_seq{S} or layertype_other_bsz{B}_seq{S}"
                raise self.error(f"{key}: unknown key (expected {expected})")

    def error(self, message: str) -> SchemaError:
        return SchemaError(message, source=self.source)

    def value(self, key: str, value: Any) -> float:
        return number(value, key, self.source, what="ms per sample")

    def seqs(self, t: int) -> set[int]:
        return {point.seq[0] for point in self.layers[t] if point.seq}

    def layer_time(
        self, t: int, seq: int, mode: TimeMode, static_batch: int | None
    ) -> StaticTime | BatchTime | SequenceTime:
        name = f"layertype_{t}"
        if mode == "sequence":
            return self._sequence(self.layers[t], name, degree=2)
        return self._at_seq(self.layers[t], name, (seq,), mode, static_batch)

    def other_time(
        self, seqs: tuple[int, ...], mode: TimeMode, static_batch: int | None
    ) -> StaticTime | BatchTime | SequenceTime:
        if mode == "sequence":
            return self._sequence(self.other, "layertype_other", degree=1)
        return self._at_seq(self.other, "layertype_other", seqs, mode, static_batch)

    def _at_seq(
        self, points: list[_TimePoint], name: str, seq: tuple[int, ...], mode: TimeMode, static_batch: int | None
    ) -> StaticTime | BatchTime:
        if not points:
            raise self.error(f"{name}_bsz{{B}}_seq{{S}}: missing (no {name} entry)")
        chosen = [p for p in points if p.seq is None or p.seq == seq]
        if not chosen:
            profiled = ", ".join(sorted({_seq_text(p.seq) for p in points if p.seq}))
            raise self.error(f"{name}: no entry at sequence length {_seq_text(seq)} (profiled: {profiled})")
        by_batch: dict[int | None, _TimePoint] = {}
        for point in chosen:
            if point.batch in by_batch and by_batch[point.batch].value != point.value:
                raise self.error(f"{point.key}: conflicts with {by_batch[point.batch].key}")
            by_batch[point.batch] = point
        if mode == "static":
            if static_batch is not None:
                if static_batch not in by_batch:
                    listed = ", ".join(str(b) for b in sorted(b for b in by_batch if b is not None))
                    raise self.error(f"{name}: no entry at batch size {static_batch} (measured: {listed})")
                point = by_batch[static_batch]
            else:
                point = by_batch[max(by_batch, key=lambda b: -1 if b is None else b)]
            return StaticTime(ms_per_sample=point.value, batch_size=point.batch)
        measured = sorted(b for b in by_batch if b is not None)
        if len(measured) < 2:
            raise self.error(
                f"{name}: batch time mode needs entries at 2 or more batch sizes at sequence length "
                f"{_seq_text(seq)}, found {len(measured)} (the reference needs 8)"
            )
        slope, intercept = polyfit(measured, [by_batch[b].value * b for b in measured], 1)
        if slope < 0:
            raise self.error(f"{name}: the batch fit has a negative slope ({slope:.4g} ms per sample)")
        return BatchTime(slope_ms_per_sample=slope, intercept_ms=intercept)

    def _sequence(self, points: list[_TimePoint], name: str, degree: int) -> SequenceTime:
        by_seq: dict[int, float] = {}
        for point in points:
            if point.batch == 1 and point.seq is not None:
                by_seq[point.seq[0]] = point.value
        if len(by_seq) < degree + 1:
            raise self.error(
                f"{name}_bsz1_seq{{S}}: sequence time mode needs bsz1 entries at {degree + 1} or more sequence "
                f"lengths, found {len(by_seq)}"
            )
        seqs = sorted(by_seq)
        coefficients = polyfit(seqs, [by_seq[s] for s in seqs], degree)
        if degree == 1:
            coefficients = (0.0, *coefficients)
        return SequenceTime(coefficients=(coefficients[0], coefficients[1], coefficients[2]))


# -------------------------------------------------------------------------------------------------------- memory
class _MemoryFile:
    def __init__(self, path: PathLike, num_types: int, megatron_sp: bool | None) -> None:
        self.source = str(path)
        self.data = load_json_object(path)
        kinds: dict[bool, str] = {}
        for key in self.data:
            layer, other = _LAYER_MEMORY.fullmatch(key), _OTHER_MEMORY.fullmatch(key)
            if layer or other:
                match = layer or other
                kinds.setdefault(match[2] is not None, key)  # type: ignore[index]
                if layer and int(layer[1]) >= num_types:
                    raise self.error(f"{key}: layer type {layer[1]} but num_layers lists {num_types} type(s)")
            elif key != "model_config" and not _RAW_MEMORY.fullmatch(key):
                raise self.error(f"{key}: unknown key (expected layertype_{{t}}[_sp] or other_memory_pp_*[_sp])")
        if megatron_sp is None:  # both kinds: the plain ones, as the reference's search without --sequence_parallel
            megatron_sp = kinds.keys() == {True}
        self.megatron_sp = bool(megatron_sp)
        self.suffix = "_sp" if self.megatron_sp else ""

    def error(self, message: str) -> SchemaError:
        return SchemaError(message, source=self.source)

    def section(self, key: str) -> dict[str, Any]:
        if key not in self.data:
            other = key.removesuffix("_sp") if key.endswith("_sp") else key + "_sp"
            hint = f" (the file has {other}: pass megatron_sp={not self.megatron_sp})" if other in self.data else ""
            raise self.error(f"{key}: missing{hint}")
        value = self.data[key]
        if not isinstance(value, dict):
            raise self.error(f"{key}: expected an object, got {type(value).__name__}")
        return value

    def by_seq(self, key: str, flat_marker: str) -> dict[tuple[int, ...] | None, tuple[str, Any]]:
        """Entries of a section by parsed sequence info; the old flat format gives ``{None: ...}``."""
        section = self.section(key)
        if flat_marker in section:
            return {None: (key, section)}
        out: dict[tuple[int, ...] | None, tuple[str, Any]] = {}
        for seq_key, entry in section.items():
            seq = _parse_seqinfo(seq_key)
            if seq is None:
                raise self.error(f'{key}.{seq_key}: expected a sequence length such as "2048" or "[512,512]"')
            if not isinstance(entry, dict):
                raise self.error(f"{key}.{seq_key}: expected an object, got {type(entry).__name__}")
            out[seq] = (f"{key}.{seq_key}", entry)
        if not out:
            raise self.error(f"{key}: is empty")
        return out

    def seqs(self, t: int) -> set[int]:
        key = f"layertype_{t}{self.suffix}"
        if key not in self.data:
            return set()
        return {seq[0] for seq in self.by_seq(key, "parameter_size") if seq}

    def pick(
        self, entries: dict[tuple[int, ...] | None, tuple[str, Any]], key: str, target: tuple[int, ...]
    ) -> tuple[str, Any]:
        if None in entries:
            return entries[None]
        if target not in entries:
            profiled = ", ".join(_seq_text(seq) for seq in sorted(entries) if seq)  # type: ignore[type-var]
            raise self.error(f"{key}: no entry for sequence length {_seq_text(target)} (profiled: {profiled})")
        return entries[target]

    def scaled_pair(
        self, entries: dict[tuple[int, ...] | None, tuple[str, Any]], key: str, target: int
    ) -> tuple[tuple[str, Any], tuple[str, Any], float]:
        """Sequence mode: (smallest entry, largest entry, target / largest)."""
        if None in entries:
            raise self.error(f"{key}: sequence memory mode needs entries by sequence length (this is the flat format)")
        ordered = sorted(entries)  # type: ignore[type-var]
        largest = ordered[-1]
        return entries[ordered[0]], entries[largest], target / largest[0]  # type: ignore[index]

    def layer(self, t: int, seq: int, mode: MemoryMode) -> tuple[float, dict[int, float], float]:
        key = f"layertype_{t}{self.suffix}"
        entries = self.by_seq(key, "parameter_size")
        if mode == "static":
            where, entry = self.pick(entries, key, (seq,))
            small_where, small, scale = where, entry, 1.0
        else:
            (small_where, small), (where, entry), scale = self.scaled_pair(entries, key, seq)
        parameter = number(
            self.field(small, small_where, "parameter_size"), f"{small_where}.parameter_size", self.source, what="MiB"
        )
        acts = self.field(entry, where, "tp_activation_per_bsz_dict")
        where = f"{where}.tp_activation_per_bsz_dict"
        if not isinstance(acts, dict):
            raise self.error(f"{where}: expected an object, got {type(acts).__name__}")
        if "checkpoint" not in acts:
            raise self.error(f"{where}.checkpoint: missing")
        if "1" not in acts:
            raise self.error(f"{where}.1: missing (the activation at tp 1)")
        checkpoint = number(acts["checkpoint"], f"{where}.checkpoint", self.source, what="MiB") * scale
        by_tp = {
            self.degree(k, where): number(v, f"{where}.{k}", self.source, what="MiB") * scale
            for k, v in acts.items()
            if k != "checkpoint"
        }
        return parameter, by_tp, checkpoint

    def other(self, position: str, seqs: tuple[int, ...], mode: MemoryMode) -> VocabMemory:
        key = f"other_memory_pp_{position}{self.suffix}"
        old = f"other_memory_pp_on{self.suffix}"
        if position != "off" and key not in self.data and old in self.data:
            stage = self.field(self.section(old), old, "first_stage" if position == "on_first" else "last_stage")
            where = f"{old}.{'first_stage' if position == 'on_first' else 'last_stage'}"
            return self.vocab_memory(stage, where, stage, where, 1.0)
        entries = self.by_seq(key, "model_states")
        if mode == "static":
            where, entry = self.pick(entries, key, seqs)
            return self.vocab_memory(entry, where, entry, where, 1.0)
        (small_where, small), (where, entry), scale = self.scaled_pair(entries, key, seqs[0])
        return self.vocab_memory(small, small_where, entry, where, scale)

    def vocab_memory(self, states: Any, states_where: str, acts: Any, acts_where: str, scale: float) -> VocabMemory:
        if not isinstance(states, dict):
            raise self.error(f"{states_where}: expected an object, got {type(states).__name__}")
        if not isinstance(acts, dict):
            raise self.error(f"{acts_where}: expected an object, got {type(acts).__name__}")
        return VocabMemory(
            model_states_mib=self.by_degree(
                self.field(states, states_where, "model_states"), f"{states_where}.model_states", 1.0
            ),
            activation_mib_per_sample=self.by_degree(
                self.field(acts, acts_where, "activation"), f"{acts_where}.activation", scale
            ),
        )

    def by_degree(self, value: Any, where: str, scale: float) -> dict[int, float]:
        if not isinstance(value, dict):  # old flat format: one number, vocabulary tp 1
            return {1: number(value, where, self.source, what="MiB") * scale}
        if not value:
            raise self.error(f"{where}: is empty")
        return {
            self.degree(k, where): number(v, f"{where}.{k}", self.source, what="MiB") * scale for k, v in value.items()
        }

    def degree(self, key: str, where: str) -> int:
        return integer(key, f"{where}.{key}", self.source, text=True)

    def field(self, entry: dict[str, Any], where: str, name: str) -> Any:
        if name not in entry:
            raise self.error(f"{where}.{name}: missing")
        return entry[name]


# ------------------------------------------------------------------------------------------------------- helpers
def _opt_int(text: str | None) -> int | None:
    return int(text) if text else None


def _parse_seqinfo(text: str) -> tuple[int, ...] | None:
    text = text.strip()
    if text.isdigit():
        return (int(text),)
    if text.startswith("[") and text.endswith("]"):
        parts = [part.strip() for part in text[1:-1].split(",")]
        if parts and all(part.isdigit() for part in parts):
            return tuple(int(part) for part in parts)
    return None


def _seq_text(seq: tuple[int, ...] | None) -> str:
    if seq is None:
        return "?"
    return str(seq[0]) if len(seq) == 1 else f"[{','.join(map(str, seq))}]"


def _infer_seq_lengths(
    times: _ComputationFile, memory: _MemoryFile, num_types: int, paths: tuple[PathLike, PathLike]
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


def _samples(
    time: StaticTime | BatchTime | SequenceTime, seq: int, batches: list[int], seqs: list[int] | None
) -> list[tuple[int, int, float]]:
    """(batch, seq, ms per sample) points that the reference reads back as ``time``."""
    if isinstance(time, StaticTime):
        return [(time.batch_size or 1, seq, time.ms_per_sample)]
    if isinstance(time, BatchTime):
        return [(b, seq, (time.slope_ms_per_sample * b + time.intercept_ms) / b) for b in batches]
    points = seqs if seqs is not None else sorted({max(1, seq * k // 4) for k in range(1, 9)})
    a, b, c = time.coefficients
    return [(1, s, a * s * s + b * s + c) for s in points]


__all__ = [
    "MemoryMode",
    "TimeMode",
    "galvatron_model_profile_file_names",
    "read_galvatron_model_profile",
    "to_galvatron_model_profile",
    "write_galvatron_model_profile",
]
