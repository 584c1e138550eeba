"""Convert between Galva's :class:`~galva_schema.Strategy` and the reference system's ``galvatron_config_*.json``.

Reference keys (spec §3) and their Galva fields:

==========================  ===============================  ==========================================================
reference key               Galva field                      when the key is missing
==========================  ===============================  ==========================================================
``pp_deg``                  ``pp``                           required
``tp_sizes_enc``            ``layers[i].tp``                 required; it also fixes the number of layers
``use_sp``                  ``layers[i].ulysses``            all 0 (``tp_sizes_enc`` then holds the Ulysses degree)
``tp_consecutive_flags``    ``layers[i].tp_consecutive``     all 1 (what the reference writes since HEAD)
``dp_types_enc``            ``layers[i].dp_type``            required; 0 = ``null`` (the default), 1 = ``zero3``
``checkpoint``              ``layers[i].checkpoint``         all 0
``global_bsz``              ``global_batch_size``            required, unless ``global_batch_size=`` is passed
``chunks``                  ``num_micro_batches``            the reference's "auto": 1 if pp = 1, else
                                                             ``ceil(global_bsz / (W/pp) / 4)``
``pp_division``             ``pp_division``                  even split, remainder on the last stage
``pipeline_type``           ``pipeline_schedule``            ``gpipe``; ``pipedream_flush`` is Galva's ``1f1b``
``default_dp_type``         ``default_dp_type``              ``ddp``
``vtp`` / ``vsp``           ``vocab.tp`` / ``vocab.sp``      1 / 0
``embed_sdp``               ``vocab.dp_type``                0 (``null``: the default); 1 = ``zero3``
``cp_sizes_enc`` / ``vcp``  ``layers[i].cp`` / ``vocab.cp``  all 1 / 1
``world_size``              ``world_size``                   the ``world_size=`` argument (both given: must agree)
==========================  ===============================  ==========================================================

Unlike the 14f5972 runtime (spec §11.1) a file without ``cp_sizes_enc`` is read, and the writer always adds
``cp_sizes_enc`` and ``vcp`` so that runtime can read Galva's output. Context-parallel ranks sit between the tp
ranks (innermost) and the data-parallel ranks, as in Megatron-LM (:mod:`galva_comm.layout`).

Normalisations (the two formats mean the same thing, the spelling differs):

* ``tp_consecutive_flags`` only matter when ``1 < tp < W/pp``; elsewhere the reference forces them to 1 and so do
  both directions here.
* ``use_sp`` = 1 on a layer of degree 1 (and ``vsp`` = 1 with ``vtp`` = 1) is the same as no parallelism: read as
  ``ulysses`` = false and written back as 0.

Not carried by the reference file: ``mixed_precision`` and ``megatron_sp`` (command-line flags there; pass them to
the reader) and ``description``. A Galva strategy whose layer uses ``ddp`` or ``zero2`` explicitly while the default
is another type cannot be written (the reference only knows "default" and "zero3"): that is an error, never a
silent change.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from galva_schema.errors import SchemaError, format_indices
from galva_schema.files import write_json_atomic
from galva_schema.reference._io import PathLike, integer, load_json_object
from galva_schema.strategy import Strategy
from galva_schema.vocabulary import PIPELINE_TYPES, DataParallelType, Precision

_SCHEDULE_NAMES = {schedule: name for name, schedule in PIPELINE_TYPES.items()}
_DP_TYPES = {member.value: member for member in DataParallelType}

KNOWN_KEYS = frozenset(
    {
        "pp_deg",
        "tp_sizes_enc",
        "tp_consecutive_flags",
        "dp_types_enc",
        "use_sp",
        "checkpoint",
        "global_bsz",
        "chunks",
        "pp_division",
        "pipeline_type",
        "default_dp_type",
        "vtp",
        "vsp",
        "embed_sdp",
        "cp_sizes_enc",
        "vcp",
        "world_size",
    }
)
"""Every key of the reference strategy file; any other key is an error (a typo would otherwise be ignored)."""


def read_galvatron_strategy(
    path_or_dict: PathLike | Mapping[str, Any],
    *,
    world_size: int | None,
    source: str | None = None,
    global_batch_size: int | None = None,
    mixed_precision: Precision | str = Precision.BF16,
    megatron_sp: bool = False,
) -> Strategy:
    """Read a reference ``galvatron_config_*.json`` (a path, or its decoded dict) into a validated Strategy.

    Args:
        path_or_dict: the file, or the decoded JSON object.
        world_size: ranks the plan runs on (``W``); ``None`` takes the file's optional ``world_size`` key.
        source: name used in error messages for a dict (defaults to the path for a file).
        global_batch_size: used only when the file has no ``global_bsz`` (the reference then takes the
            ``--global_train_batch_size`` flag).
        mixed_precision, megatron_sp: run settings that the reference passes as flags, not in the file.

    Raises:
        SchemaError: one line naming the file and the key (``use_sp[3]: expected 0 or 1, got 2``), or the Galva
        field and layer when the converted plan cannot run (``layers[3].tp: 16 is larger than ...``).
    """
    if isinstance(path_or_dict, Mapping):
        data = dict(path_or_dict)
    else:
        source = source or str(path_or_dict)
        data = load_json_object(path_or_dict)
    return _Reader(data, source).strategy(world_size, global_batch_size, Precision(mixed_precision), megatron_sp)


def to_galvatron_strategy(strategy: Strategy) -> dict[str, Any]:
    """The reference file's dict for ``strategy`` (keys in the order the reference search writes them).

    Raises:
        SchemaError: the schedule is not one the reference runs (gpipe, 1f1b), or a layer or the vocabulary uses
        an explicit ``ddp``/``zero2`` different from ``default_dp_type``: the reference format cannot express them.
    """
    if strategy.pipeline_schedule not in _SCHEDULE_NAMES:
        raise SchemaError(
            f"pipeline_schedule: {strategy.pipeline_schedule.value} cannot be written as a reference strategy; "
            "the reference runs only gpipe and 1f1b (pipedream_flush)"
        )
    ranks_per_stage = strategy.ranks_per_stage
    dp_types: list[int] = []
    bad: dict[str, list[int]] = {}
    for index, layer in enumerate(strategy.layers):
        code = _dp_code(layer.dp_type, strategy.default_dp_type)
        if code is None:
            bad.setdefault(str(layer.dp_type.value if layer.dp_type else None), []).append(index)
        dp_types.append(code or 0)
    if bad:
        parts = [
            f"layers[{format_indices(indices)}].dp_type: {name} differs from default_dp_type "
            f"{strategy.default_dp_type.value}; the reference format only has 0 (the default) and 1 (zero3)"
            for name, indices in bad.items()
        ]
        raise SchemaError("; ".join(parts))
    embed_sdp = _dp_code(strategy.vocab.dp_type, strategy.default_dp_type)
    if embed_sdp is None:
        raise SchemaError(
            f"vocab.dp_type: {strategy.vocab.dp_type.value if strategy.vocab.dp_type else None} differs from "
            f"default_dp_type {strategy.default_dp_type.value}; the reference format only has embed_sdp 0 or 1 (zero3)"
        )
    layers = strategy.layers
    return {
        "pp_deg": strategy.pp,
        "tp_sizes_enc": _enc(layer.tp for layer in layers),
        "tp_consecutive_flags": _enc(
            int(layer.tp_consecutive or not 1 < layer.tp < ranks_per_stage) for layer in layers
        ),
        "dp_types_enc": _enc(dp_types),
        "use_sp": _enc(int(layer.ulysses) for layer in layers),
        "checkpoint": _enc(int(layer.checkpoint) for layer in layers),
        "global_bsz": strategy.global_batch_size,
        "chunks": strategy.num_micro_batches,
        "pp_division": _enc(strategy.pp_division),
        "pipeline_type": _SCHEDULE_NAMES[strategy.pipeline_schedule],
        "default_dp_type": strategy.default_dp_type.value,
        "vtp": strategy.vocab.tp,
        "vsp": int(strategy.vocab.sp),
        "embed_sdp": embed_sdp,
        "cp_sizes_enc": _enc(layer.cp for layer in layers),
        "vcp": strategy.vocab.cp,
        "world_size": strategy.world_size,
    }


def write_galvatron_strategy(strategy: Strategy, path: PathLike) -> Path:
    """Write ``strategy`` as a reference ``galvatron_config_*.json``, atomically; returns the path."""
    return write_json_atomic(path, to_galvatron_strategy(strategy))


# ------------------------------------------------------------------------------------------------------ internals
def _dp_code(dp_type: DataParallelType | None, default: DataParallelType) -> int | None:
    """0 = default, 1 = zero3, None = not expressible."""
    if dp_type is None or dp_type == default:
        return 0
    if dp_type is DataParallelType.ZERO3:
        return 1
    return None


def _enc(values: Any) -> str:
    return ",".join(str(int(value)) for value in values)


class _Reader:
    def __init__(self, data: dict[str, Any], source: str | None) -> None:
        self.data = data
        self.source = source

    def error(self, message: str) -> SchemaError:
        return SchemaError(message, source=self.source)

    def strategy(
        self, world_size: int | None, global_batch_size: int | None, precision: Precision, megatron_sp: bool
    ) -> Strategy:
        unknown = sorted(set(self.data) - KNOWN_KEYS)
        if unknown:
            raise self.error(f"{', '.join(unknown)}: unknown key{'s' if len(unknown) > 1 else ''}")
        world = self.world_size(world_size)
        pp = self.int_key("pp_deg")
        if world % pp:
            raise self.error(f"pp_deg: {pp} does not divide world_size {world}")
        ranks_per_stage = world // pp
        tp = self.enc("tp_sizes_enc", None, minimum=1)
        num_layers = len(tp)
        use_sp = self.flags("use_sp", num_layers, default=0)
        consecutive = self.flags("tp_consecutive_flags", num_layers, default=1)
        dp_types = self.flags("dp_types_enc", num_layers, default=None)
        checkpoint = self.flags("checkpoint", num_layers, default=0)
        cp = self.enc("cp_sizes_enc", num_layers, minimum=1) if "cp_sizes_enc" in self.data else [1] * num_layers
        vcp = self.int_key("vcp") if "vcp" in self.data else 1

        if "global_bsz" in self.data:
            batch = self.int_key("global_bsz")
        elif global_batch_size is not None:
            batch = global_batch_size
        else:
            raise self.error(
                "global_bsz: missing (the reference runtime falls back to --global_train_batch_size; "
                "pass global_batch_size=)"
            )
        micro_batches = (  # the reference's "chunks" key is its micro-batch count
            self.int_key("chunks") if "chunks" in self.data else _auto_micro_batches(batch, ranks_per_stage, pp)
        )
        division = self.enc("pp_division", pp, minimum=1) if "pp_division" in self.data else None
        schedule = self.choice("pipeline_type", PIPELINE_TYPES, "gpipe")
        default_dp = self.choice("default_dp_type", _DP_TYPES, "ddp")
        vtp = self.int_key("vtp") if "vtp" in self.data else 1
        vsp = self.flag_key("vsp", 0)
        embed_sdp = self.flag_key("embed_sdp", 0)

        layers = [
            {
                "tp": tp[i],
                "ulysses": bool(use_sp[i]) and tp[i] > 1,
                "tp_consecutive": bool(consecutive[i]) or not 1 < tp[i] < ranks_per_stage,
                "cp": cp[i],
                "dp_type": DataParallelType.ZERO3 if dp_types[i] else None,
                "checkpoint": bool(checkpoint[i]),
            }
            for i in range(num_layers)
        ]
        plan = {
            "world_size": world,
            "pp": pp,
            "pp_division": division,
            "pipeline_schedule": schedule,
            "num_micro_batches": micro_batches,
            "global_batch_size": batch,
            "mixed_precision": precision,
            "default_dp_type": default_dp,
            "megatron_sp": megatron_sp,
            "layers": layers,
            "vocab": {
                "tp": vtp,
                "sp": bool(vsp) and vtp > 1,
                "cp": vcp,
                "dp_type": DataParallelType.ZERO3 if embed_sdp else None,
            },
        }
        try:
            return Strategy.from_dict(plan, source=self.source)
        except SchemaError as err:
            raise self.error(_to_reference_names(err.detail)) from None

    def world_size(self, given: int | None) -> int:
        in_file = self.int_key("world_size") if "world_size" in self.data else None
        if given is None and in_file is None:
            raise self.error("world_size: not in the file; give the number of ranks (--world-size, nodes x GPUs)")
        if given is not None and in_file is not None and given != in_file:
            raise self.error(f"world_size: the file says {in_file} ranks but the run has {given} (--world-size)")
        return given if given is not None else in_file  # type: ignore[return-value]

    def int_key(self, key: str) -> int:
        if key not in self.data:
            raise self.error(f"{key}: missing")
        return integer(self.data[key], key, self.source)

    def flag_key(self, key: str, default: int) -> int:
        if key not in self.data:
            return default
        value = integer(self.data[key], key, self.source, minimum=0)
        if value > 1:
            raise self.error(f"{key}: expected 0 or 1, got {value}")
        return value

    def choice(self, key: str, options: Mapping[str, Any], default: str) -> Any:
        value = self.data.get(key, default)
        if value not in options:
            raise self.error(f"{key}: expected one of {', '.join(options)}, got {value!r}")
        return options[value]

    def enc(self, key: str, length: int | None, *, minimum: int) -> list[int]:
        """A comma-separated per-layer list (a JSON list of ints is accepted too)."""
        if key not in self.data:
            raise self.error(f"{key}: missing")
        raw = self.data[key]
        if isinstance(raw, str):
            items: list[Any] = [item.strip() for item in raw.split(",")] if raw.strip() else []
        elif isinstance(raw, int) and not isinstance(raw, bool):
            items = [raw]
        elif isinstance(raw, list):
            items = raw
        else:
            raise self.error(f'{key}: expected a comma-separated string such as "1,2,2", got {raw!r}')
        if not items:
            raise self.error(f"{key}: is empty")
        text = isinstance(raw, str)
        values = [
            integer(item, f"{key}[{i}]", self.source, minimum=minimum, text=text) for i, item in enumerate(items)
        ]
        if length is not None and len(values) != length:
            reference = "tp_sizes_enc has" if key != "pp_division" else "pp_deg is"
            unit = " layers" if key != "pp_division" else ""
            raise self.error(f"{key}: has {len(values)} entries but {reference} {length}{unit}")
        return values

    def flags(self, key: str, length: int, *, default: int | None) -> list[int]:
        if key not in self.data:
            if default is None:
                raise self.error(f"{key}: missing")
            return [default] * length
        values = self.enc(key, length, minimum=0)
        bad = [i for i, value in enumerate(values) if value > 1]
        if bad:
            raise self.error(f"{key}[{format_indices(bad)}]: expected 0 or 1, got {values[bad[0]]}")
        return values

_REFERENCE_NAMES = [
    (re.compile(r"\blayers(\[[\d.,]+\])\.tp\b"), r"tp_sizes_enc\1"),
    (re.compile(r"\blayers(\[[\d.,]+\])\.ulysses\b"), r"use_sp\1"),
    (re.compile(r"\blayers(\[[\d.,]+\])\.cp\b"), r"cp_sizes_enc\1"),
    (re.compile(r"\blayers(\[[\d.,]+\])"), r"tp_sizes_enc\1"),
    (re.compile(r"\bvocab\.tp\b"), "vtp"),
    (re.compile(r"\bvocab\.sp\b"), "vsp"),
    (re.compile(r"\bvocab\.cp\b"), "vcp"),
    (re.compile(r"\bvocab\b"), "vtp"),
    (re.compile(r"\bglobal_batch_size\b"), "global_bsz"),
    (re.compile(r"\bnum_micro_batches\b"), "chunks"),
    (re.compile(r"^pp\b"), "pp_deg"),
]


def _to_reference_names(detail: str) -> str:
    """Say ``tp_sizes_enc[3]`` rather than ``layers[3].tp`` to someone who wrote a reference file."""
    for pattern, replacement in _REFERENCE_NAMES:
        detail = pattern.sub(replacement, detail)
    return detail


def _auto_micro_batches(batch: int, ranks_per_stage: int, pp: int) -> int:
    """The reference's ``chunks = -1``: 1 without pipelining, else about four samples per rank per micro-batch."""
    if pp == 1:
        return 1
    return max(1, math.ceil(batch / ranks_per_stage / 4))


def strategy_file_name(strategy: Strategy, model_name: str, *, num_nodes: int, memory_gb: int) -> str:
    """The reference search's output name ``galvatron_config_{model}_{N}nodes_{G}gpus_per_node_{MEM}GB_{prec}.json``."""
    if strategy.world_size % num_nodes:
        raise SchemaError(f"num_nodes: {num_nodes} does not divide world_size {strategy.world_size}")
    gpus = strategy.world_size // num_nodes
    return (
        f"galvatron_config_{model_name}_{num_nodes}nodes_{gpus}gpus_per_node_{memory_gb}GB_"
        f"{strategy.mixed_precision.value}.json"
    )


__all__ = [
    "KNOWN_KEYS",
    "PIPELINE_TYPES",
    "read_galvatron_strategy",
    "strategy_file_name",
    "to_galvatron_strategy",
    "write_galvatron_strategy",
]
