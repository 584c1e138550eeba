"""Convert between Galva's :class:`~galva_schema.HardwareProfile` and the reference system's hardware files.

The reference keeps one cluster's profile in four files (spec §1), named after the cluster shape
(``N`` nodes of ``G`` GPUs, ``W = N * G``):

==================================================  =========================================================
reference file and keys                             Galva field
==================================================  =========================================================
``allreduce_bandwidth_{N}nodes_{G}gpus_per_node``   ``allreduce`` (bus bandwidth, GB/s). Required: every
``.json``: ``allreduce_size_{n}_consec_{0|1}``      ``n = W, W/2, ... , 2`` with both layouts, except ``n = W``
                                                    which has only ``consec_1``.
``p2p_bandwidth_{N}nodes_{G}gpus_per_node.json``:   ``p2p`` (GB/s), whatever ``p`` the file measured.
``pp_size_{p}``
``sp_time_{N}nodes_{G}gpus_per_node.json``:         ``allreduce_time`` / ``all_to_all_time`` (ms against MiB).
``allreduce_size_{n}_{M}MB_time``,                  Optional: without the file both tables are empty.
``all2all_size_{n}_{M}MB_time``
``overlap_coefficient.json``: ``overlap_coe``       ``overlap_slowdown``, clamped to at least 1 (as measured
                                                    by the reference profiler)
==================================================  =========================================================

The ``sp_time`` tables keep the **raw measured times**. The reference reader halves every all-reduce time
("converted to all-gather / reduce-scatter time") and fits ``t = m * MB + c`` with scipy, needing at least 8 sizes
per group. Both are cost-model decisions, so they belong to galva-search: there ``CollectiveTimes.linear_fit`` gives
the fit and the caller halves where the model wants a reduce-scatter.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from galva_schema.cluster import ClusterSpec
from galva_schema.errors import SchemaError
from galva_schema.files import write_json_atomic
from galva_schema.hardware import AllreduceBandwidth, CollectiveTimes, HardwareProfile, P2PBandwidth
from galva_schema.reference._io import PathLike, load_json_object, number, plain

_ALLREDUCE_KEY = re.compile(r"allreduce_size_(\d+)_consec_([01])")
_P2P_KEY = re.compile(r"pp_size_(\d+)")
_TIME_KEY = re.compile(r"(allreduce|all2all)_size_(\d+)_(\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)MB_time")
OVERLAP_FILE = "overlap_coefficient.json"


@dataclass(frozen=True)
class GalvatronHardwareFiles:
    """The four reference file paths of one cluster shape."""

    allreduce: Path
    p2p: Path
    sp_time: Path
    overlap: Path

    @classmethod
    def in_directory(cls, directory: PathLike, *, num_nodes: int, gpus_per_node: int) -> GalvatronHardwareFiles:
        directory = Path(directory)
        names = galvatron_hardware_file_names(num_nodes, gpus_per_node)
        return cls(*(directory / names[key] for key in ("allreduce", "p2p", "sp_time", "overlap")))


def galvatron_hardware_file_names(num_nodes: int, gpus_per_node: int) -> dict[str, str]:
    """File names the reference uses for a cluster of ``num_nodes`` x ``gpus_per_node``."""
    shape = f"{num_nodes}nodes_{gpus_per_node}gpus_per_node"
    return {
        "allreduce": f"allreduce_bandwidth_{shape}.json",
        "p2p": f"p2p_bandwidth_{shape}.json",
        "sp_time": f"sp_time_{shape}.json",
        "overlap": OVERLAP_FILE,
    }


def read_galvatron_hardware(
    directory: PathLike | None = None,
    *,
    num_nodes: int,
    gpus_per_node: int,
    allreduce_path: PathLike | None = None,
    p2p_path: PathLike | None = None,
    sp_time_path: PathLike | None = None,
    overlap_path: PathLike | None = None,
    backend: str | None = "nccl",
    device_memory_mib: float | None = None,
    device_name: str | None = None,
) -> HardwareProfile:
    """Read the reference hardware files of an ``num_nodes`` x ``gpus_per_node`` cluster.

    Pass the ``directory`` that holds them (``galvatron/profile_hardware/hardware_configs/``), explicit paths, or
    both (explicit paths win). The allreduce, p2p and overlap files are required; ``sp_time`` is optional when
    given through the directory (older profiles lack it) but required when its path is given explicitly.

    Raises:
        SchemaError: naming the file and the key, e.g.
        ``allreduce_bandwidth_1nodes_8gpus_per_node.json: allreduce_size_4_consec_0: missing``.
    """
    if directory is None and None in (allreduce_path, p2p_path, overlap_path):
        raise SchemaError("read_galvatron_hardware: give the directory or the allreduce, p2p and overlap file paths")
    cluster = ClusterSpec(
        num_nodes=num_nodes, gpus_per_node=gpus_per_node, device_memory_mib=device_memory_mib, device_name=device_name
    )
    world = cluster.world_size
    default = (
        GalvatronHardwareFiles.in_directory(directory, num_nodes=num_nodes, gpus_per_node=gpus_per_node)
        if directory is not None
        else None
    )
    allreduce_file = Path(allreduce_path) if allreduce_path is not None else default.allreduce  # type: ignore[union-attr]
    p2p_file = Path(p2p_path) if p2p_path is not None else default.p2p  # type: ignore[union-attr]
    overlap_file = Path(overlap_path) if overlap_path is not None else default.overlap  # type: ignore[union-attr]
    if sp_time_path is not None:
        sp_time_file: Path | None = Path(sp_time_path)
    else:
        sp_time_file = default.sp_time if default is not None and default.sp_time.exists() else None

    allreduce = _read_allreduce(allreduce_file, world)
    p2p = _read_p2p(p2p_file, world)
    allreduce_time, all_to_all_time = _read_sp_time(sp_time_file, world) if sp_time_file else ((), ())
    overlap = _read_overlap(overlap_file)
    return HardwareProfile(
        cluster=cluster,
        backend=backend,
        allreduce=allreduce,
        p2p=p2p,
        allreduce_time=allreduce_time,
        all_to_all_time=all_to_all_time,
        overlap_slowdown=overlap,
    )


def to_galvatron_hardware(profile: HardwareProfile) -> dict[str, dict[str, Any]]:
    """The reference files for ``profile``: ``{file name: JSON object}`` (``sp_time`` only if it has tables)."""
    names = galvatron_hardware_file_names(profile.cluster.num_nodes, profile.cluster.gpus_per_node)
    order = sorted(profile.allreduce, key=lambda e: (-e.group_size, not e.consecutive))
    files: dict[str, dict[str, Any]] = {
        names["allreduce"]: {
            f"allreduce_size_{e.group_size}_consec_{int(e.consecutive)}": e.bus_bandwidth_gb_per_s for e in order
        },
        names["p2p"]: {f"pp_size_{e.pp}": e.bandwidth_gb_per_s for e in sorted(profile.p2p, key=lambda e: e.pp)},
    }
    if profile.allreduce_time or profile.all_to_all_time:
        times: dict[str, Any] = {}
        for op, table in (("allreduce", profile.allreduce_time), ("all2all", profile.all_to_all_time)):
            for entry in sorted(table, key=lambda e: -e.group_size):
                for size, time in zip(entry.message_mib, entry.time_ms):
                    times[f"{op}_size_{entry.group_size}_{plain(size)}MB_time"] = time
        files[names["sp_time"]] = times
    files[names["overlap"]] = {"overlap_coe": profile.overlap_slowdown}
    return files


def write_galvatron_hardware(profile: HardwareProfile, directory: PathLike) -> list[Path]:
    """Write the reference hardware files of ``profile`` into ``directory`` (each atomically); returns the paths."""
    directory = Path(directory)
    return [write_json_atomic(directory / name, data) for name, data in to_galvatron_hardware(profile).items()]


# ------------------------------------------------------------------------------------------------------ internals
def _group_sizes(world: int) -> list[int]:
    """``W, W/2, ...`` while the size stays an integer >= 2: the sizes the reference profiles."""
    sizes, size = [], world
    while size >= 2:
        sizes.append(size)
        if size % 2:
            break
        size //= 2
    return sizes


def _read_allreduce(path: Path, world: int) -> tuple[AllreduceBandwidth, ...]:
    data, source = load_json_object(path), str(path)
    found: dict[tuple[int, bool], float] = {}
    for key, value in data.items():
        match = _ALLREDUCE_KEY.fullmatch(key)
        if not match:
            raise SchemaError(f"{key}: unknown key (expected allreduce_size_{{n}}_consec_{{0|1}})", source=source)
        size, consecutive = int(match[1]), match[2] == "1"
        if not 2 <= size <= world:
            raise SchemaError(f"{key}: group size {size} is outside 2..{world} (world size {world})", source=source)
        found[(size, consecutive)] = number(value, key, source, what="GB/s", positive=True)
    for size in _group_sizes(world):
        for consecutive in (True, False) if size < world else (True,):
            if (size, consecutive) not in found:
                raise SchemaError(f"allreduce_size_{size}_consec_{int(consecutive)}: missing", source=source)
    return tuple(
        AllreduceBandwidth(group_size=size, consecutive=consecutive, bus_bandwidth_gb_per_s=value)
        for (size, consecutive), value in sorted(found.items(), key=lambda item: (-item[0][0], not item[0][1]))
    )


def _read_p2p(path: Path, world: int) -> tuple[P2PBandwidth, ...]:
    data, source = load_json_object(path), str(path)
    out = []
    for key, value in data.items():
        match = _P2P_KEY.fullmatch(key)
        if not match:
            raise SchemaError(f"{key}: unknown key (expected pp_size_{{p}})", source=source)
        pp = int(match[1])
        if not 2 <= pp <= world or world % pp:
            raise SchemaError(f"{key}: pp {pp} must be >= 2 and divide the world size {world}", source=source)
        out.append(P2PBandwidth(pp=pp, bandwidth_gb_per_s=number(value, key, source, what="GB/s", positive=True)))
    if not out:
        raise SchemaError("pp_size_2: missing (the file has no pp_size_{p} entry)", source=source)
    return tuple(sorted(out, key=lambda e: e.pp))


def _read_sp_time(path: Path, world: int) -> tuple[tuple[CollectiveTimes, ...], tuple[CollectiveTimes, ...]]:
    data, source = load_json_object(path), str(path)
    tables: dict[str, dict[int, dict[float, float]]] = {"allreduce": defaultdict(dict), "all2all": defaultdict(dict)}
    for key, value in data.items():
        match = _TIME_KEY.fullmatch(key)
        if not match:
            raise SchemaError(
                f"{key}: unknown key (expected allreduce_size_{{n}}_{{M}}MB_time or all2all_size_{{n}}_{{M}}MB_time)",
                source=source,
            )
        op, size, mib = match[1], int(match[2]), float(match[3])
        if not 2 <= size <= world:
            raise SchemaError(f"{key}: group size {size} is outside 2..{world} (world size {world})", source=source)
        if mib <= 0:
            raise SchemaError(f"{key}: message size must be positive", source=source)
        tables[op][size][mib] = number(value, key, source, what="ms")
    result = []
    for op in ("allreduce", "all2all"):
        entries = []
        for size in sorted(tables[op], reverse=True):
            points = sorted(tables[op][size].items())
            if len(points) < 2:
                raise SchemaError(
                    f"{op}_size_{size}_*MB_time: only {len(points)} message size; at least 2 are needed for a fit "
                    "(the reference needs 8)",
                    source=source,
                )
            entries.append(
                CollectiveTimes(
                    group_size=size, message_mib=tuple(m for m, _ in points), time_ms=tuple(t for _, t in points)
                )
            )
        result.append(tuple(entries))
    return result[0], result[1]


def _read_overlap(path: Path) -> float:
    data, source = load_json_object(path), str(path)
    unknown = sorted(set(data) - {"overlap_coe"})
    if unknown:
        raise SchemaError(f"{', '.join(unknown)}: unknown key (expected only overlap_coe)", source=source)
    if "overlap_coe" not in data:
        raise SchemaError("overlap_coe: missing", source=source)
    return max(1.0, number(data["overlap_coe"], "overlap_coe", source, what="slowdown", positive=True))


__all__ = [
    "OVERLAP_FILE",
    "GalvatronHardwareFiles",
    "galvatron_hardware_file_names",
    "read_galvatron_hardware",
    "to_galvatron_hardware",
    "write_galvatron_hardware",
]
