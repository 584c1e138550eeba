"""The plan's figures: headline numbers, predicted memory per stage against the budget, the predicted time of an
iteration by kind and of a micro-batch per stage, and the search counts."""

from __future__ import annotations

from html import escape

from galva_search.report.plan import PlanFacts
from galva_search.report.style import NEAR, OK, OVER, TIME_PARTS, WIDTH
from galva_search.report.svg import card, fmt_time, nice_step, swatch

_COUNT_NAMES = {  # field of SearchCounts: its row in the table
    "tasks": "tasks tried",
    "solved": "solved",
    "infeasible": "infeasible (nothing fits)",
    "pruned_bound": "pruned by time bound",
    "pruned_memory": "pruned by memory bound",
    "dp_problems": "stage DPs run",
    "dp_reused": "stage DPs reused",
    "refined": "refined",
}
_LINE_LABEL_PX = 11
"""Font size of the memory chart's usable / budget labels."""


def headline(plan: PlanFacts) -> str:
    s = plan.strategy
    cards = [
        card("iteration time", fmt_time(plan.summary.iteration_time_s), main=True),
        card("throughput", f"{plan.summary.throughput_samples_per_s:.2f} samples/s", main=True),
        card("devices", str(s.world_size)),
        card("pp", str(s.pp)),
        card("division", "/".join(str(n) for n in s.pp_division)),
        card("schedule", s.pipeline_schedule.value + (f" × {s.virtual_stages}" if s.virtual_stages > 1 else "")),
        card("global batch", str(s.global_batch_size)),
        card("micro-batches × size", f"{s.num_micro_batches} × {s.micro_batch_size}"),
    ]
    if plan.summary.search_time_s is not None:
        cards.append(card("search time", f"{plan.summary.search_time_s:.2f} s"))
    return f'<div class="cards" id="headline">{"".join(cards)}</div>'


def memory_chart(plan: PlanFacts) -> str:
    """Vertical bars, one per stage, with the usable-budget and total-budget lines."""
    usable, budget = plan.summary.usable_memory_mib, plan.summary.memory_budget_mib
    mems = plan.summary.stage_memory_mib
    n = len(mems)
    width, height, left, top, bottom = WIDTH, 300, 70, 20, 40
    plot_h = height - top - bottom
    top_mib = max([budget, usable, *mems]) * 1.08
    bar_slot = (width - left - 20) / max(n, 1)
    bar_w = min(90.0, bar_slot * 0.6)

    def y(mib: float) -> float:
        return top + plot_h * (1 - mib / top_mib)

    parts = [f'<svg id="memory-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'role="img" aria-label="memory per stage">']
    step = nice_step(top_mib / 5)
    for k in range(int(top_mib // step) + 1):  # light grid with round MiB ticks
        mib = step * k
        parts.append(f'<line x1="{left}" x2="{width - 20}" y1="{y(mib):.1f}" y2="{y(mib):.1f}" stroke="#eee"/>'
                     f'<text x="{left - 6}" y="{y(mib) + 4:.1f}" font-size="11" text-anchor="end" fill="#777">'
                     f'{mib:.0f}</text>')
    parts.append(f'<text x="14" y="{top + plot_h / 2:.0f}" font-size="12" fill="#555" text-anchor="middle" '
                 f'transform="rotate(-90 14 {top + plot_h / 2:.0f})">MiB per device</text>')
    for stage, mib in enumerate(mems):
        x = left + bar_slot * stage + (bar_slot - bar_w) / 2
        colour = _memory_colour(mib, usable, budget)
        title = f"stage {stage}: {mib:.0f} MiB of {usable:.0f} MiB usable, budget {budget:.0f} MiB"
        share = f"{100 * mib / usable:.0f}% of usable" if usable > 0 else ""
        if y(0) - y(mib) >= 40:  # value inside the top of the bar, white on colour
            label = (f'<text x="{x + bar_w / 2:.1f}" y="{y(mib) + 16:.1f}" font-size="12" text-anchor="middle" '
                     f'font-weight="600" fill="#fff">{mib:.0f} MiB</text><text x="{x + bar_w / 2:.1f}" '
                     f'y="{y(mib) + 30:.1f}" font-size="10" text-anchor="middle" fill="#fff">{share}</text>')
        else:
            label = (f'<text x="{x + bar_w / 2:.1f}" y="{y(mib) - 5:.1f}" font-size="12" text-anchor="middle" '
                     f'font-weight="600">{mib:.0f} MiB</text>')
        parts.append(
            f'<g class="mem-bar" data-stage="{stage}" data-mib="{mib:.0f}"><title>{escape(title)}</title>'
            f'<rect x="{x:.1f}" y="{y(mib):.1f}" width="{bar_w:.1f}" height="{y(0) - y(mib):.1f}" fill="{colour}" '
            f'rx="3"/>{label}'
            f'<text x="{x + bar_w / 2:.1f}" y="{height - bottom + 18}" font-size="12" text-anchor="middle">'
            f'stage {stage}</text></g>'
        )
    lines = [(usable, "usable", "6 4", "#D1495B")]
    if budget - usable > 0.5:
        lines.append((budget, "budget", "2 3", "#444"))
    else:
        lines = [(usable, "usable = budget", "6 4", "#D1495B")]
    for value, label, dash, colour in lines:
        # the budget label sits above its line and the usable label below its own: the budget line is never below
        # the usable one, so the two labels are a font height apart or more, however close the values
        dy = _LINE_LABEL_PX + 2 if label == "usable" else -5
        parts.append(
            f'<g class="budget-line" data-kind="{label.split()[0]}" data-mib="{value:.0f}"><title>{label} '
            f'{value:.0f} MiB</title><line x1="{left}" x2="{width - 20}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
            f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="{dash}"/><text class="line-label" '
            f'data-kind="{label.split()[0]}" x="{width - 24}" y="{y(value) + dy:.1f}" font-size="{_LINE_LABEL_PX}" '
            f'text-anchor="end" fill="{colour}" stroke="#fff" stroke-width="3" paint-order="stroke">{label} '
            f'{value:.0f} MiB</text></g>'
        )
    parts.append(f'<line x1="{left}" x2="{width - 20}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#999"/></svg>')
    legend = (f'<div class="legend"><span><svg width="14" height="14"><rect width="14" height="14" fill="{OK}"/>'
              f'</svg>within usable memory</span><span><svg width="14" height="14"><rect width="14" height="14" '
              f'fill="{NEAR}"/></svg>in the reserve</span><span><svg width="14" height="14"><rect width="14" '
              f'height="14" fill="{OVER}"/></svg>over budget</span></div>')
    return "".join(parts) + legend


def _memory_colour(mib: float, usable: float, budget: float) -> str:
    if mib > budget:
        return OVER
    return NEAR if mib > usable else OK


def time_chart(plan: PlanFacts) -> str:
    """Horizontal bars of the time per micro-batch of every stage; the slowest (the pipeline's pace) is marked."""
    times = plan.summary.stage_micro_batch_time_s
    width, left, bar_h, gap, top = WIDTH, 70, 24, 8, 10
    height = top + len(times) * (bar_h + gap) + 10
    longest = max(times) if times else 1.0
    scale = (width - left - 130) / (longest or 1.0)
    parts = [f'<svg id="time-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="time per micro-batch per stage">']
    for stage, t in enumerate(times):
        y = top + stage * (bar_h + gap)
        slowest = t == longest
        colour = "#0072B2" if slowest else "#8FB8DE"
        title = f"stage {stage}: {t * 1e3:.2f} ms per micro-batch{' (slowest stage)' if slowest else ''}"
        parts.append(
            f'<g class="time-bar" data-stage="{stage}" data-ms="{t * 1e3:.2f}"><title>{escape(title)}</title>'
            f'<text x="{left - 8}" y="{y + bar_h / 2 + 4:.1f}" font-size="12" text-anchor="end">stage {stage}</text>'
            f'<rect x="{left}" y="{y:.1f}" width="{max(t * scale, 1):.1f}" height="{bar_h}" fill="{colour}" rx="3"/>'
            f'<text x="{left + t * scale + 6:.1f}" y="{y + bar_h / 2 + 4:.1f}" font-size="12">{t * 1e3:.2f} ms'
            f'{" · slowest" if slowest and len(times) > 1 else ""}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def time_breakdown(plan: PlanFacts) -> str:
    """One stacked bar: the iteration split by kind (the summary's ``time_breakdown_s``), with a table of numbers."""
    breakdown = plan.summary.time_breakdown_s
    parts = [(k, v) for k, v in (breakdown.model_dump() if breakdown else {}).items() if v > 0]
    if not parts:
        return '<p class="note">No time breakdown in this summary (written by an older galva-search).</p>'
    total = sum(v for _, v in parts)
    width, left, height, bar_h = WIDTH, 20, 70, 34
    scale = (width - 2 * left) / total
    svg = [f'<svg id="time-breakdown" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="predicted time of one iteration by kind">']
    x = float(left)
    for kind, seconds in parts:
        label, colour = TIME_PARTS.get(kind, (kind, "#999999"))
        w = seconds * scale
        share = 100 * seconds / total
        svg.append(f'<g class="time-part" data-kind="{escape(kind)}" data-s="{seconds:.9g}"><title>{escape(label)}: '
                   f'{fmt_time(seconds)} ({share:.1f}%)</title><rect x="{x:.1f}" y="10" width="{max(w, 0.5):.1f}" '
                   f'height="{bar_h}" fill="{colour}"/>')
        if w > 60:
            svg.append(f'<text x="{x + w / 2:.1f}" y="{10 + bar_h / 2 + 4}" font-size="12" text-anchor="middle" '
                       f'fill="#222">{share:.0f}%</text>')
        svg.append("</g>")
        x += w
    svg.append(f'<text x="{left}" y="{height - 8}" font-size="11" fill="#777">0</text><text x="{width - left}" '
               f'y="{height - 8}" font-size="11" fill="#777" text-anchor="end">{fmt_time(total)} per iteration'
               f'</text></svg>')
    legend = "".join(f'<span>{swatch(TIME_PARTS.get(k, (k, "#999999"))[1])}{escape(TIME_PARTS.get(k, (k,))[0])}'
                     f'</span>' for k, _ in parts)
    rows = "".join(f'<tr><td>{escape(TIME_PARTS.get(k, (k,))[0])}</td><td class="n">{fmt_time(v)}</td>'
                   f'<td class="n">{100 * v / total:.1f}%</td></tr>' for k, v in parts)
    return (f'{"".join(svg)}<div class="legend">{legend}</div><table id="time-table"><tr><th>kind</th>'
            f'<th>per iteration</th><th>share</th></tr>{rows}</table>')


def counts_table(plan: PlanFacts) -> str:
    counts = plan.summary.counts.model_dump()
    rows = "".join(
        f'<tr><td>{escape(_COUNT_NAMES.get(k, k))}</td><td class="n">{n}</td></tr>' for k, n in counts.items()
    )
    if plan.summary.search_time_s is not None:
        rows += f'<tr><td>search time</td><td class="n">{plan.summary.search_time_s:.2f} s</td></tr>'
    return f'<table id="search-counts"><tr><th>search log</th><th>count</th></tr>{rows}</table>'
