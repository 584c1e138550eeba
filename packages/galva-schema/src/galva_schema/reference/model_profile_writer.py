"""Write Galva's :class:`~galva_schema.ModelProfile` as the reference system's two model profile files (their keys
are described in :mod:`galva_schema.reference.model_profile`).

Writing produces the processed form at the profile's sequence lengths: one entry per sequence length in the memory
file, and for the computation file the profile's own form (a static value, ``batch_sizes`` points of a batch fit, or
``sequence_lengths`` points of a sequence fit), so the reference search reads it back in the same mode.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from galva_schema.files import write_json_atomic
from galva_schema.model_profile import BatchTime, ModelProfile, SequenceTime, StaticTime, VocabMemory
from galva_schema.reference._io import PathLike
from galva_schema.reference._model_profile_files import VOCAB_POSITIONS


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
    for position, field in VOCAB_POSITIONS.items():
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


__all__ = ["to_galvatron_model_profile", "write_galvatron_model_profile"]
