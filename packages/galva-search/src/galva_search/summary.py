"""Human and machine summaries of a search result."""

from __future__ import annotations

from typing import Any

from galva_schema import SCHEMA_VERSION, Strategy
from galva_search.search import SearchResult


def layer_runs(strategy: Strategy) -> list[tuple[int, int, int, str]]:
    """Runs of consecutive layers with the same plan inside each stage: ``(stage, first, last, label)``, where the
    label is the reference's compact form, e.g. ``1-2*-4f-c``."""
    out: list[tuple[int, int, int, str]] = []
    for stage in range(strategy.pp):
        for index in strategy.stage_layers(stage):
            label = strategy.layer_summary(index)
            if out and out[-1][0] == stage and out[-1][3] == label and out[-1][2] == index - 1:
                out[-1] = (stage, out[-1][1], index, label)
            else:
                out.append((stage, index, index, label))
    return out


def vocab_label(strategy: Strategy) -> str:
    kind = "sp" if strategy.vocab.sp else "tp"
    dp_type = strategy.vocab_dp_type.value
    return f"vocab {kind} {strategy.vocab.tp}, dp {strategy.vocab_dp} ({dp_type})"


def schedule_label(strategy: Strategy) -> str:
    """``1f1b``, ``zb-h1``, ``interleaved-1f1b (2 chunks per stage)``, ..."""
    v = strategy.virtual_stages
    return strategy.pipeline_schedule.value + (f" ({v} chunks per stage)" if v > 1 else "")


def text_summary(result: SearchResult) -> str:
    """Multi-line report: the plan as runs of layers per stage, predicted time, throughput and memory."""
    s = result.strategy
    lines = [
        f"galva-search: {s.world_size} devices, pp {s.pp}, division {list(s.pp_division)}, "
        f"{schedule_label(s)}, global batch {s.global_batch_size} in {s.num_micro_batches} micro-batches "
        f"of {s.micro_batch_size}",
        f"  {vocab_label(s)}; default dp type {s.default_dp_type.value}; precision {s.mixed_precision.value}"
        f"{'; Megatron-SP' if s.megatron_sp else ''}",
    ]
    for stage, first, last, label in layer_runs(s):
        span = f"{first}" if first == last else f"{first}-{last}"
        lines.append(f"  stage {stage}, layers {span}: {label}")
    lines.append(
        f"  predicted {result.iteration_time_s:.4f} s per iteration, {result.throughput:.3f} samples/s"
    )
    for stage, (mem, u) in enumerate(zip(result.stage_memory_mib, result.stage_time_s)):
        lines.append(
            f"  stage {stage}: {mem:.0f} MiB of {result.usable_memory_mib:.0f} MiB usable "
            f"(budget {result.memory_budget_mib:.0f} MiB), {u * 1e3:.2f} ms per micro-batch"
        )
    c = result.counts
    lines.append(
        f"  searched in {result.search_time_s:.2f} s: {c.get('tasks', 0)} tasks, {c.get('solved', 0)} solved, "
        f"{c.get('infeasible', 0)} infeasible, {c.get('pruned_bound', 0)} pruned by bound, "
        f"{c.get('pruned_memory', 0)} pruned by memory, {c.get('dp_problems', 0)} stage DPs"
    )
    return "\n".join(lines)


def json_summary(result: SearchResult) -> dict[str, Any]:
    """The ``--summary-json`` content (``kind: galva.search_summary``; a report, not an input to other stages)."""
    s = result.strategy
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "galva.search_summary",
        "iteration_time_s": result.iteration_time_s,
        "throughput_samples_per_s": result.throughput,
        "global_batch_size": s.global_batch_size,
        "num_micro_batches": s.num_micro_batches,
        "pp": s.pp,
        "pp_division": list(s.pp_division),
        "pipeline_schedule": s.pipeline_schedule.value,
        "virtual_stages": s.virtual_stages,
        "vocab": {"tp": s.vocab.tp, "sp": s.vocab.sp, "dp_type": s.vocab_dp_type.value},
        "memory_budget_mib": result.memory_budget_mib,
        "usable_memory_mib": result.usable_memory_mib,
        "stage_memory_mib": result.stage_memory_mib,
        "stage_micro_batch_time_s": result.stage_time_s,
        "time_breakdown_s": result.time_breakdown_s,
        "layer_runs": [
            {"stage": stage, "first": first, "last": last, "strategy": label}
            for stage, first, last, label in layer_runs(s)
        ],
        "search_time_s": result.search_time_s,
        "counts": result.counts,
    }
