"""Measured communication performance of a cluster (written by galva-profiler, read by galva-search)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, model_validator

from galva_schema._base import GalvaFile, GalvaModel
from galva_schema.cluster import ClusterSpec
from galva_schema.errors import SchemaError


class AllreduceBandwidth(GalvaModel):
    """All-reduce bus bandwidth (nccl-tests ``busbw``) of groups of one size and layout."""

    group_size: int = Field(ge=2)
    consecutive: bool = Field(description="Groups of consecutive ranks (true) or ranks strided by W/group_size.")
    bus_bandwidth_gb_per_s: PositiveFloat = Field(description="Bus bandwidth, 1e9 bytes per second.")


class P2PBandwidth(GalvaModel):
    """Point-to-point bandwidth between neighbouring stages of a pipeline of degree ``pp``."""

    pp: int = Field(ge=2)
    bandwidth_gb_per_s: PositiveFloat
    latency_ms: NonNegativeFloat = Field(
        0.0, description="Time of a small send not explained by the bandwidth (ms per send); 0: not measured."
    )


class CollectiveTimes(GalvaModel):
    """Time of one collective against message size, for groups of ``group_size`` consecutive ranks."""

    group_size: int = Field(ge=2)
    message_mib: tuple[PositiveFloat, ...] = Field(min_length=2, description="Message sizes, MiB, ascending.")
    time_ms: tuple[NonNegativeFloat, ...] = Field(min_length=2, description="Time per collective, ms.")

    @model_validator(mode="after")
    def _check(self) -> CollectiveTimes:
        if len(self.message_mib) != len(self.time_ms):
            raise ValueError(
                f"message_mib has {len(self.message_mib)} sizes but time_ms has {len(self.time_ms)} times "
                f"(group_size {self.group_size})"
            )
        if list(self.message_mib) != sorted(set(self.message_mib)):
            raise ValueError(f"message_mib must be strictly ascending (group_size {self.group_size})")
        return self

    def linear_fit(self) -> tuple[float, float]:
        """Least-squares ``time_ms = slope * message_mib + intercept``; returns (slope ms/MiB, intercept ms)."""
        n = len(self.message_mib)
        mean_x = sum(self.message_mib) / n
        mean_y = sum(self.time_ms) / n
        var = sum((x - mean_x) ** 2 for x in self.message_mib)
        cov = sum((x - mean_x) * (y - mean_y) for x, y in zip(self.message_mib, self.time_ms))
        slope = cov / var
        return slope, mean_y - slope * mean_x


class CallExtra(GalvaModel):
    """What one call of a collective costs inside a busy step beyond its idle curve, for groups of ``group_size``;
    ``"p2p"``: one pipeline send to a receiver already waiting, between compute segments, beyond the idle send, for
    pipelines of degree ``group_size``."""

    group_size: int = Field(ge=2)
    collective: Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
    ms: NonNegativeFloat = Field(
        description="ms per call: the ranks' arrival spread and wake-up between compute segments, beyond the curve's "
        "own 4 KiB time."
    )


class HardwareProfile(GalvaFile):
    """Communication profile of a cluster. Every table is keyed by group size (and layout where it matters)."""

    kind: Literal["galva.hardware_profile"] = "galva.hardware_profile"
    cluster: ClusterSpec
    backend: str | None = Field(None, description="Communication backend measured: 'nccl', 'gloo', ...")
    allreduce: tuple[AllreduceBandwidth, ...] = Field(description="Bus bandwidth by group size and layout.")
    p2p: tuple[P2PBandwidth, ...] = Field((), description="Pipeline p2p bandwidth by pp degree.")
    allreduce_time: tuple[CollectiveTimes, ...] = Field((), description="All-reduce time against message size.")
    all_to_all_time: tuple[CollectiveTimes, ...] = Field((), description="All-to-all time against message size.")
    all_gather_time: tuple[CollectiveTimes, ...] = Field(
        (), description="All-gather time against message size (the gathered output per rank)."
    )
    reduce_scatter_time: tuple[CollectiveTimes, ...] = Field(
        (), description="Reduce-scatter time against message size (the scattered input per rank)."
    )
    overlap_slowdown: float = Field(
        1.0, ge=1.0, description="Factor (>= 1) by which compute and communication slow each other when overlapped."
    )
    compute_slowdown: float = Field(
        1.0,
        ge=1.0,
        description="Factor (>= 1) by which compute runs slower with every rank of the profiled world computing at "
        "once than with one rank alone (ranks sharing cores or memory bandwidth); the model profile is measured alone.",
    )
    compute_reference_ms: PositiveFloat | None = Field(
        None,
        description="ms of one fp32 256 x 256 matmul on one rank alone, the median of samples taken between the "
        "concurrency test's rounds by the layers' clock (the model profile's compute_reference_ms is the same "
        "matmul in the minutes its layers were timed). None: not measured.",
    )
    base_memory_mib: NonNegativeFloat | None = Field(
        None,
        description="Memory one rank's process holds before any model is built (MiB), measured after the imports, the "
        "process group's creation and a first collective: on GPU the CUDA context and communicator buffers (device "
        "memory in use outside the allocator), on CPU the process's resident set. galva-search reserves it per "
        "device; None: not measured (an older profile: galva-search's --context-memory default).",
    )
    optimizer_ms_per_million_parameters: NonNegativeFloat = Field(
        0.0,
        description="Milliseconds of one AdamW step (fp32 master weights, foreach) per million parameters a rank "
        "updates, with every rank stepping at once; galva-search adds the slowest stage's step to each iteration. "
        "0: not measured.",
    )
    processors_per_node: PositiveInt | None = Field(
        None,
        description="Processors one node's ranks may compute on, measured by the hardware profile where ranks run "
        "on CPUs (the union of the ranks' CPU affinity); fewer than the ranks per node: ranks share processors, so a "
        "rank idle in the pipeline bubble hands its processor to another (galva-search prices a step as the larger "
        "of the schedule's critical path and the node's compute over the shared processors). None: one device per "
        "rank (GPU), or not measured.",
    )
    call_extra: tuple[CallExtra, ...] = Field(
        (),
        description="Per group size and collective, what a call costs inside a busy step beyond its idle curve (every "
        "rank alternating compute and calls against the compute alone); galva-search adds it to every call it "
        "prices. Empty: not measured (0).",
    )

    @property
    def shares_processors(self) -> bool:
        """Whether a node's ranks outnumber the processors they may compute on."""
        return self.processors_per_node is not None and self.processors_per_node < self.cluster.gpus_per_node

    @model_validator(mode="after")
    def _check(self) -> HardwareProfile:
        world = self.cluster.world_size
        problems: list[str] = []
        seen: set[tuple[int, bool]] = set()
        for i, entry in enumerate(self.allreduce):
            key = (entry.group_size, entry.consecutive)
            if key in seen:
                problems.append(f"allreduce[{i}]: duplicate entry for group_size {key[0]} consecutive={key[1]}")
            seen.add(key)
            if entry.group_size > world:
                problems.append(f"allreduce[{i}].group_size: {entry.group_size} exceeds the world size {world}")
        for name, table in (
            ("allreduce_time", self.allreduce_time),
            ("all_to_all_time", self.all_to_all_time),
            ("all_gather_time", self.all_gather_time),
            ("reduce_scatter_time", self.reduce_scatter_time),
        ):
            sizes = [entry.group_size for entry in table]
            if len(sizes) != len(set(sizes)):
                problems.append(f"{name}: more than one entry for the same group_size")
        extras = [(entry.group_size, entry.collective) for entry in self.call_extra]
        if len(extras) != len(set(extras)):
            problems.append("call_extra: more than one entry for the same group_size and collective")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def allreduce_bandwidth(self, group_size: int, consecutive: bool = True) -> float:
        """Bus bandwidth (GB/s) for groups of ``group_size``; the world-sized group has only one layout."""
        if group_size == self.cluster.world_size:
            consecutive = True
        for entry in self.allreduce:
            if entry.group_size == group_size and entry.consecutive == consecutive:
                return entry.bus_bandwidth_gb_per_s
        layout = "consecutive" if consecutive else "strided"
        raise SchemaError(f"allreduce: no entry for group_size {group_size} ({layout})")

    def p2p_latency_ms(self, pp: int) -> float:
        """Per-send latency between neighbouring stages of a pipeline of degree ``pp`` (0 when not profiled)."""
        return next((entry.latency_ms for entry in self.p2p if entry.pp == pp), 0.0)

    def p2p_bandwidth(self, pp: int) -> float:
        for entry in self.p2p:
            if entry.pp == pp:
                return entry.bandwidth_gb_per_s
        raise SchemaError(f"p2p: no entry for pp {pp}")
