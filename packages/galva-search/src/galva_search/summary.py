"""The search summary: built for the best plan (a :class:`galva_schema.SearchSummary`, the ``--summary-json`` file),
and told to a person (the lines ``galva-search`` prints)."""

from __future__ import annotations

from collections.abc import Mapping

from galva_schema import LayerRun, SearchCounts, SearchSummary, Strategy, SummaryVocab, TimeBreakdown


def layer_runs(strategy: Strategy) -> list[LayerRun]:
    """Runs of consecutive layers with the same plan inside each stage, the label being the reference's compact
    form, e.g. ``1-2*-4f-c``."""
    out: list[LayerRun] = []
    for stage in range(strategy.pp):
        for index in strategy.stage_layers(stage):
            label = strategy.layer_summary(index)
            last = out[-1] if out else None
            if last is not None and last.stage == stage and last.strategy == label and last.last == index - 1:
                out[-1] = last.model_copy(update={"last": index})
            else:
                out.append(LayerRun(stage=stage, first=index, last=index, strategy=label))
    return out


def search_summary(
    strategy: Strategy,
    *,
    iteration_time_s: float,
    stage_memory_mib: list[float],
    stage_micro_batch_time_s: list[float],
    time_breakdown_s: Mapping[str, float],
    memory_budget_mib: float,
    usable_memory_mib: float,
    search_time_s: float | None,
    counts: Mapping[str, int],
    base_memory_mib: float | None = None,
) -> SearchSummary:
    """The summary of ``strategy`` with its predicted cost and what the search did."""
    s = strategy
    return SearchSummary(
        iteration_time_s=iteration_time_s,
        throughput_samples_per_s=s.global_batch_size / iteration_time_s,
        global_batch_size=s.global_batch_size,
        num_micro_batches=s.num_micro_batches,
        pp=s.pp,
        pp_division=s.pp_division,
        pipeline_schedule=s.pipeline_schedule,
        virtual_stages=s.virtual_stages,
        vocab=SummaryVocab(tp=s.vocab.tp, sp=s.vocab.sp, dp_type=s.vocab_dp_type),
        memory_budget_mib=memory_budget_mib,
        usable_memory_mib=usable_memory_mib,
        stage_memory_mib=tuple(stage_memory_mib),
        stage_micro_batch_time_s=tuple(stage_micro_batch_time_s),
        time_breakdown_s=TimeBreakdown(**time_breakdown_s) if time_breakdown_s else None,
        layer_runs=tuple(layer_runs(s)),
        search_time_s=search_time_s,
        counts=SearchCounts(**counts),
        base_memory_mib=base_memory_mib,
    )


def vocab_label(strategy: Strategy) -> str:
    kind = "sp" if strategy.vocab.sp else "tp"
    dp_type = strategy.vocab_dp_type.value
    cp = f", cp {strategy.vocab.cp}" if strategy.vocab.cp > 1 else ""
    return f"vocab {kind} {strategy.vocab.tp}{cp}, dp {strategy.vocab_dp} ({dp_type})"


def schedule_label(strategy: Strategy) -> str:
    """``1f1b``, ``zb-h1``, ``interleaved-1f1b (2 model chunks per stage)``, ..."""
    v = strategy.virtual_stages
    return strategy.pipeline_schedule.value + (f" ({v} model chunks per stage)" if v > 1 else "")


def text_summary(strategy: Strategy, summary: SearchSummary) -> str:
    """Multi-line report: the plan as runs of layers per stage, predicted time, throughput and memory."""
    s = strategy
    lines = [
        f"galva-search: {s.world_size} devices, pp {s.pp}, division {list(s.pp_division)}, "
        f"{schedule_label(s)}, global batch {s.global_batch_size} in {s.num_micro_batches} micro-batches "
        f"of {s.micro_batch_size}",
        f"  {vocab_label(s)}; default dp type {s.default_dp_type.value}; precision {s.mixed_precision.value}"
        f"{'; Megatron-SP' if s.megatron_sp else ''}",
    ]
    for run in summary.layer_runs:
        span = f"{run.first}" if run.first == run.last else f"{run.first}-{run.last}"
        lines.append(f"  stage {run.stage}, layers {span}: {run.strategy}")
    lines.append(
        f"  predicted {summary.iteration_time_s:.4f} s per iteration, "
        f"{summary.throughput_samples_per_s:.3f} samples/s"
    )
    for stage, (mem, u) in enumerate(zip(summary.stage_memory_mib, summary.stage_micro_batch_time_s)):
        lines.append(
            f"  stage {stage}: {mem:.0f} MiB of {summary.usable_memory_mib:.0f} MiB usable "
            f"(budget {summary.memory_budget_mib:.0f} MiB), {u * 1e3:.2f} ms per micro-batch"
        )
    c = summary.counts
    searched = f"{summary.search_time_s:.2f} s" if summary.search_time_s is not None else "an unknown time"
    lines.append(
        f"  searched in {searched}: {c.tasks} tasks, {c.solved} solved, {c.infeasible} infeasible, "
        f"{c.pruned_bound} pruned by bound, {c.pruned_memory} pruned by memory, {c.dp_problems} stage DPs"
    )
    return "\n".join(lines)
