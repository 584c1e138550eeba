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
    step_time = steady(records, "step_time_s")
    rows.append(("step_time", "step time", plan.summary.iteration_time_s, step_time, "s"))
    samples = plan.strategy.global_batch_size / step_time if step_time else None
    rows.append(("throughput", "throughput", plan.summary.throughput_samples_per_s, samples, "samples/s"))
    mem = [v for _, v in series(records, "peak_memory_mib")]
    stage0 = plan.summary.stage_memory_mib[0] if plan.summary.stage_memory_mib else math.nan
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
    legend = (f'<div class="legend"><span>{swatch(PREDICTED)}predicted by galva-search</span>'
              f'<span>{swatch(MEASURED)}measured (median step without the first; memory: rank 0 high-water mark,'
              f' on a CPU the process\'s resident set)</span></div>')
    table = "".join(
        f'<tr><td>{escape(label)} ({unit})</td><td class="n">{fmt(p)}</td><td class="n">'
        f'{fmt(m) if m is not None else "–"}</td><td class="n">'
        f'{f"{m / p:.2f}×" if m is not None and p and math.isfinite(p) else "–"}</td></tr>'
        for _, label, p, m, unit in rows
    )
    return (f'{"".join(svg)}{legend}<table id="measured-table"><tr><th></th><th>predicted</th><th>measured</th>'
            f'<th>measured / predicted</th></tr>{table}</table>')
