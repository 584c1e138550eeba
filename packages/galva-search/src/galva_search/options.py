"""What a search is asked (:class:`SearchOptions`) and what it answers (:class:`SearchResult`, :class:`TaskRecord`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from galva_schema import PipelineSchedule, SearchSummary, Strategy
from galva_search.space import Candidate, SpaceOptions

GIB = 1024.0  # MiB per GiB
DEFAULT_RESERVE_FRACTION = 0.05
"""Share of the budget kept free by default for the caching allocator's fragmentation (``--memory-reserve``)."""


@dataclass(frozen=True)
class SearchOptions:
    """What to search over, besides the strategy space itself."""

    memory_budget_mib: float
    batch_sizes: tuple[int, ...]
    space: SpaceOptions = field(default_factory=SpaceOptions)
    num_micro_batches: int | None = None  # fixed micro-batch count (the reference's ``settle_chunk``)
    fine_grained: bool = True  # per-layer strategies (True) or one strategy for every layer (False)
    memory_reserve_mib: float | None = None  # None: DEFAULT_RESERVE_FRACTION of the budget
    threads: int = 0  # DP threads, 0 = all cores
    wave_size: int = 16  # tasks solved per solve_many call
    partitions: tuple[str, ...] = ("even", "memory", "time")
    refine_division: bool = True  # refine the best pipelined plan: its partition, then its stage boundaries
    exhaustive: bool = False  # solve every task whose memory bound fits (no pruning by time bound): tests, debugging
    # pipeline schedules to choose from (pp > 1); None: the cost model's own (CostSettings.pipeline_schedule) alone
    schedules: tuple[PipelineSchedule, ...] | None = None
    virtual_stages: tuple[int, ...] = (2, 4)  # model chunks per stage tried with interleaved-1f1b (each >= 2)

    @property
    def reserve_mib(self) -> float:
        """MiB of the budget left unplanned: allocator fragmentation only. Transient buffers (ZeRO-3 gathers,
        recomputation) are terms of the memory model, not of this reserve (docs/cost-model.md §4)."""
        if self.memory_reserve_mib is not None:
            return self.memory_reserve_mib
        return DEFAULT_RESERVE_FRACTION * self.memory_budget_mib

    @property
    def usable_mib(self) -> float:
        """MiB per device the plan may use."""
        return self.memory_budget_mib - self.reserve_mib


def batch_size_range(min_size: int, max_size: int, scale: int) -> list[int]:
    """Batch sizes ``min, min + scale, ... <= max`` with ``min`` rounded down to a multiple of ``scale`` (at least
    ``scale``), as the reference's ``set_searching_bsz`` (16..64 step 8 -> 16, 24, ..., 64; max 50 step 16 -> 48)."""
    if scale < 1 or min_size < 1 or max_size < 1:
        raise ValueError("batch sizes and scale must be >= 1")
    start = max(min_size, scale)
    start -= start % scale
    return list(range(start, max_size + 1, scale))


@dataclass
class TaskRecord:
    """One line of the search log."""

    batch_size: int
    micro_batches: int
    pp: int
    division: tuple[int, ...]
    vocab: str
    bound_s: float
    status: str  # "best", "solved", "infeasible", "pruned-bound", "pruned-memory", "... (refined)"
    time_s: float | None = None
    schedule: str = "1f1b"  # pipeline schedule, with ":v" model chunks per stage when interleaved

    def line(self) -> str:
        t = f"{self.time_s:.6f}s" if self.time_s is not None else "-"
        thr = f"{self.batch_size / self.time_s:.3f}/s" if self.time_s else "-"
        div = ",".join(map(str, self.division))
        return (
            f"bsz={self.batch_size} micro_batches={self.micro_batches} pp={self.pp} division=[{div}] "
            f"schedule={self.schedule} {self.vocab} "
            f"bound={self.bound_s:.6f}s status={self.status} time={t} throughput={thr}"
        )


@dataclass
class SearchResult:
    """The best plan, its predicted cost and what the search did (the summary ``--summary-json`` writes), the
    candidate of every layer, and the search log."""

    strategy: Strategy
    summary: SearchSummary
    candidates: list[Candidate]  # the chosen candidate of every layer
    log: list[TaskRecord] = field(default_factory=list)


class NoFeasibleStrategy(RuntimeError):
    """No plan fits the memory budget."""
