"""Measured against predicted: a training run's step time, throughput and peak memory beside what galva-search
predicted for its plan."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from galva_search.report.plan import PlanFacts
from galva_search.report.style import MEASURED, PREDICTED, WIDTH
from galva_search.report.svg import fmt, swatch
from galva_search.report.training import series, steady


def measured_vs_predicted(plan: PlanFacts, records: Sequence[Mapping[str, Any]]) -> str:
    """Pairs of bars (predicted, measured): iteration time, throughput, and the peak memory of stage 0 (rank 0 logs
    the metrics); a ratio column says how far apart they are."""
    rows: list[tuple[str, str, float, float | None, str]] = []  # kind, label, predicted, measured, unit
    bands: dict[str, float] = {}  # kind: relative noise band, where a check measured one
    check = plan.check
    step_time = check.step_time_s.measured if check else steady(records, "step_time_s")
    rows.append(("step_time", "step time", plan.summary.iteration_time_s, step_time, "s"))
    samples = plan.strategy.global_batch_size / step_time if step_time else None
    rows.append(("throughput", "throughput", plan.summary.throughput_samples_per_s, samples, "samples/s"))
    stage0 = plan.summary.stage_memory_mib[0] if plan.summary.stage_memory_mib else math.nan
    if check is not None:
        rows.append(("memory", "peak memory, stage 0", stage0, check.peak_memory_mib.measured, "MiB"))
        rows.append(("base", "base memory, stage 0", check.base_memory_mib.predicted, check.base_memory_mib.measured,
                     "MiB"))
        bands = {"step_time": check.step_time_s.noise, "throughput": check.step_time_s.noise,
                 "memory": check.peak_memory_mib.noise, "base": check.base_memory_mib.noise}
    else:
        mem = [v for _, v in series(records, "peak_memory_mib")]
        rows.append(("memory", "peak memory, stage 0", stage0, max(mem) if mem else None, "MiB"))
    width, left, row_h, top = WIDTH, 170, 46, 10
    height = top + len(rows) * row_h + 10
    svg = [f'<svg id="measured-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="measured against predicted">']
    for i, (kind, label, predicted, measured, unit) in enumerate(rows):
        y = top + i * row_h
        top_value = max(v for v in (predicted, measured, 1e-12) if v is not None and math.isfinite(v))
        scale = (width - left - 200) / top_value
        svg.append(f'<text x="{left - 8}" y="{y + 20}" font-size="12" text-anchor="end">{escape(label)}</text>')
        for j, (which, value, colour) in enumerate((("predicted", predicted, PREDICTED),
                                                    ("measured", measured, MEASURED))):
            if value is None or not math.isfinite(value):
                continue
            yy = y + 4 + j * 17
            text = f"{fmt(value)} {unit} {which}"
            svg.append(f'<g class="mvp-bar" data-kind="{kind}" data-which="{which}" data-value="{value:.6g}">'
                       f'<title>{escape(label)}: {escape(text)}</title><rect x="{left}" y="{yy}" '
                       f'width="{max(value * scale, 1):.1f}" height="15" fill="{colour}" rx="2"/>'
                       f'<text x="{left + value * scale + 6:.1f}" y="{yy + 12}" font-size="11">{escape(text)}</text>'
                       f'</g>')
    svg.append("</svg>")
    memory_note = ("base before the model plus the peak above it: GPU the allocator's peak, CPU the resident "
                   "high-water mark" if check else "rank 0 high-water mark, on a CPU the process's resident set")
    legend = (f'<div class="legend"><span>{swatch(PREDICTED)}predicted by galva-search</span>'
              f'<span>{swatch(MEASURED)}measured (median step without the first; memory: {memory_note})</span>'
              f'</div>')
    table = "".join(
        f'<tr data-kind="{kind}"><td>{escape(label)} ({unit})</td><td class="n">{fmt(p)}</td><td class="n">'
        f'{fmt(m) if m is not None else "–"}</td><td class="n">'
        f'{f"{m / p:.2f}×" if m is not None and p and math.isfinite(p) else "–"}</td>'
        + (f'<td class="n">±{bands[kind]:.0%}</td><td>{_verdict(p, m, bands[kind])}</td>' if bands else "")
        + "</tr>"
        for kind, label, p, m, unit in rows
    )
    band_heads = "<th>noise band</th><th>agreement</th>" if bands else ""
    return (f'{"".join(svg)}{legend}<table id="measured-table"><tr><th></th><th>predicted</th><th>measured</th>'
            f'<th>measured / predicted</th>{band_heads}</tr>{table}</table>')


def _verdict(predicted: float, measured: float | None, band: float) -> str:
    """Whether measured is within the noise band of predicted (throughput: the inverse of time, same band)."""
    if measured is None or not predicted or not math.isfinite(predicted):
        return "–"
    return "within the band" if abs(measured / predicted - 1.0) <= band else "outside the band"
