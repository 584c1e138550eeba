"""``SearchSummary``: what galva-search predicts for the plan it wrote (``galva-search --summary-json``).

The summary goes beside the :class:`~galva_schema.Strategy` it describes: predicted iteration time and throughput,
memory and micro-batch time per stage against the budget, the iteration split by kind, the plan as runs of layers,
and what the search did. galva-report and ``galva run`` read it through this class; :meth:`SearchSummary.mismatch`
says whether a summary belongs to a strategy. The plan facts it repeats from the strategy (``pp``, division,
schedule, batch) are there so that a summary read alone says what it is about, and so that a summary given with the
wrong strategy is refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from galva_schema._base import GalvaFile, GalvaModel
from galva_schema.strategy import Strategy
from galva_schema.vocabulary import DataParallelType, PipelineSchedule

__all__ = ["LayerRun", "SearchCounts", "SearchSummary", "SummaryVocab", "TimeBreakdown"]


class SummaryVocab(GalvaModel):
    """The vocabulary layers' plan (the strategy's ``vocab``, with its effective data-parallel type)."""

    tp: PositiveInt = Field(description="Vocabulary tp (or sequence-parallel) degree.")
    sp: bool = Field(description="Sequence split of degree tp instead of vocabulary tensor parallel.")
    dp_type: DataParallelType = Field(description="Effective data-parallel type of the vocabulary layers.")


class TimeBreakdown(GalvaModel):
    """Seconds of one predicted iteration by kind; the parts sum to ``iteration_time_s``.

    The slowest stage sets the pace: its micro-batch time, split by kind, counts once per micro-batch; the
    schedule's fill and drain is the ``bubble``; the gradient-sync tail after the last backward is in ``dp``.
    """

    compute: float = Field(ge=0.0, description="Layer and vocabulary forward, backward and recomputation.")
    tp: float = Field(ge=0.0, description="Megatron tp, Megatron-SP and Ulysses collectives.")
    dp: float = Field(ge=0.0, description="Gradient synchronisation and ZeRO-3 gathers.")
    p2p: float = Field(ge=0.0, description="Pipeline point-to-point sends.")
    redistribution: float = Field(ge=0.0, description="Re-sharding between layers of different layouts.")
    bubble: float = Field(ge=0.0, description="Fill and drain of the pipeline schedule.")
    optimizer: float = Field(0.0, ge=0.0, description="The optimizer step after the last backward (slowest stage).")


class SearchCounts(GalvaModel):
    """What the search did (how many tasks it tried and how each ended)."""

    tasks: NonNegativeInt = Field(0, description="Tasks enumerated (batch, micro-batches, pp, schedule, ...).")
    solved: NonNegativeInt = Field(0, description="Tasks whose every stage found a plan.")
    infeasible: NonNegativeInt = Field(0, description="Tasks of which some stage fits no plan.")
    pruned_bound: NonNegativeInt = Field(0, description="Tasks skipped: their time bound cannot beat the best.")
    pruned_memory: NonNegativeInt = Field(0, description="Tasks skipped: their memory bound does not fit.")
    dp_problems: NonNegativeInt = Field(0, description="Stage dynamic programmes run.")
    dp_reused: NonNegativeInt = Field(0, description="Stage dynamic programmes answered from an earlier one.")
    refined: NonNegativeInt = Field(0, description="Partitions tried while refining the best pipelined plan.")


class LayerRun(GalvaModel):
    """Consecutive layers of one stage with the same plan."""

    stage: NonNegativeInt
    first: NonNegativeInt = Field(description="First layer of the run (model order).")
    last: NonNegativeInt = Field(description="Last layer of the run, inclusive.")
    strategy: str = Field(description="The layers' plan in the reference's compact form, e.g. '1-2*-4f-c'.")


class SearchSummary(GalvaFile):
    """galva-search's prediction for the strategy it wrote, and what the search did."""

    kind: Literal["galva.search_summary"] = "galva.search_summary"
    iteration_time_s: float = Field(gt=0.0, description="Predicted seconds per training iteration.")
    throughput_samples_per_s: float = Field(gt=0.0, description="global_batch_size / iteration_time_s.")
    global_batch_size: PositiveInt
    num_micro_batches: PositiveInt
    pp: PositiveInt
    pp_division: tuple[PositiveInt, ...] = Field(description="Layers per model chunk, in model order.")
    pipeline_schedule: PipelineSchedule
    virtual_stages: PositiveInt = Field(1, description="Model chunks per pipeline stage.")
    vocab: SummaryVocab
    memory_budget_mib: float = Field(gt=0.0, description="Memory per device the search was given (--memory).")
    usable_memory_mib: float = Field(gt=0.0, description="The budget less the reserve: what a plan may use.")
    stage_memory_mib: tuple[float, ...] = Field(description="Predicted peak memory per device, per stage.")
    stage_micro_batch_time_s: tuple[float, ...] = Field(description="Predicted seconds per micro-batch, per stage.")
    time_breakdown_s: TimeBreakdown | None = Field(None, description="The iteration by kind; null when unknown.")
    layer_runs: tuple[LayerRun, ...] = Field(description="The plan as runs of layers with the same plan per stage.")
    search_time_s: float | None = Field(None, ge=0.0, description="Seconds the search took.")
    counts: SearchCounts = Field(default_factory=SearchCounts)
    base_memory_mib: float | None = Field(
        None,
        ge=0.0,
        description="Per-device base memory inside stage_memory_mib (the process before any model: CUDA context and "
        "communicator buffers, or the resident set on CPU); null in a summary written before it was recorded.",
    )

    @field_validator("time_breakdown_s", mode="before")
    @classmethod
    def _empty_breakdown(cls, value: Any) -> Any:
        return None if value == {} else value  # summaries written before the field was typed held {} when unknown

    @model_validator(mode="after")
    def _one_entry_per_stage(self) -> SearchSummary:
        chunks = self.pp * self.virtual_stages
        if len(self.pp_division) != chunks:
            raise ValueError(f"pp_division: {len(self.pp_division)} entries, expected pp x virtual_stages = {chunks}")
        for name in ("stage_memory_mib", "stage_micro_batch_time_s"):
            if len(getattr(self, name)) != self.pp:
                raise ValueError(f"{name}: {len(getattr(self, name))} entries, expected one per stage (pp {self.pp})")
        return self

    def mismatch(self, strategy: Strategy) -> str | None:
        """The first plan fact of this summary that ``strategy`` contradicts, as ``key X, but Y``; None when the
        summary can be the one galva-search wrote with ``strategy``."""
        layers, division = sum(self.pp_division), list(self.pp_division)
        if layers != strategy.num_layers:
            return f"pp_division {division} plans {layers} layers, but the model has {strategy.num_layers}"
        facts: dict[str, tuple[Any, Any]] = {
            "pp_division": (division, list(strategy.pp_division)),
            "pp": (self.pp, strategy.pp),
            "virtual_stages": (self.virtual_stages, strategy.virtual_stages),
            "pipeline_schedule": (self.pipeline_schedule.value, strategy.pipeline_schedule.value),
            "global_batch_size": (self.global_batch_size, strategy.global_batch_size),
            "num_micro_batches": (self.num_micro_batches, strategy.num_micro_batches),
        }
        for key, (mine, theirs) in facts.items():
            if mine != theirs:
                return f"{key} is {mine!r}, but {theirs!r}"
        return None
