"""Parsers of the reference's two processed model profile files (the key grammar is in
:mod:`galva_schema.reference.model_profile`): each checks its keys and answers one layer type's or the vocabulary's
time or memory in a given mode, raising a one-line :class:`~galva_schema.SchemaError` naming the file and key."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from galva_schema.errors import SchemaError
from galva_schema.model_profile import BatchTime, SequenceTime, StaticTime, VocabMemory
from galva_schema.reference._io import PathLike, integer, load_json_object, number
from galva_schema.reference.fitting import polyfit

TimeMode = Literal["static", "batch", "sequence"]
MemoryMode = Literal["static", "sequence"]

_SEQINFO = r"(\d+|\[\s*\d+(?:\s*,\s*\d+)*\s*\])"
_LAYER_TIME = re.compile(r"layertype_(\d+)(?:_bsz(\d+))?(?:_seq(\d+))?")
_OTHER_TIME = re.compile(r"layertype_other(?:_(\d+))?(?:_bsz(\d+))?(?:_seq" + _SEQINFO + r")?")
_RAW_TIME = re.compile(r"layernum\[.*")
_LAYER_MEMORY = re.compile(r"layertype_(\d+)(_sp)?")
_OTHER_MEMORY = re.compile(r"other_memory_pp_(off|on_first|on_last|on)(_sp)?")
_RAW_MEMORY = re.compile(r"\d+_\d+_\d+(?:_c)?(?:_vtp)?(?:_sp)?")
VOCAB_POSITIONS = {"off": "memory_pp_off", "on_first": "memory_pp_first", "on_last": "memory_pp_last"}


@dataclass(frozen=True)
class _TimePoint:
    batch: int | None
    seq: tuple[int, ...] | None
    value: float
    key: str


# --------------------------------------------------------------------------------------------------- computation
class ComputationFile:
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
                seq = parse_seqinfo(other[3]) if other[3] else None
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
            profiled = ", ".join(sorted({seq_text(p.seq) for p in points if p.seq}))
            raise self.error(f"{name}: no entry at sequence length {seq_text(seq)} (profiled: {profiled})")
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
                f"{seq_text(seq)}, found {len(measured)} (the reference needs 8)"
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
class MemoryFile:
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
            seq = parse_seqinfo(seq_key)
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
            profiled = ", ".join(seq_text(seq) for seq in sorted(entries) if seq)  # type: ignore[type-var]
            raise self.error(f"{key}: no entry for sequence length {seq_text(target)} (profiled: {profiled})")
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


def parse_seqinfo(text: str) -> tuple[int, ...] | None:
    text = text.strip()
    if text.isdigit():
        return (int(text),)
    if text.startswith("[") and text.endswith("]"):
        parts = [part.strip() for part in text[1:-1].split(",")]
        if parts and all(part.isdigit() for part in parts):
            return tuple(int(part) for part in parts)
    return None


def seq_text(seq: tuple[int, ...] | None) -> str:
    if seq is None:
        return "?"
    return str(seq[0]) if len(seq) == 1 else f"[{','.join(map(str, seq))}]"
