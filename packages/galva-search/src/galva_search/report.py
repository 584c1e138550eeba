"""The ``--report-html`` page: one self-contained HTML file (inline CSS and SVG, no scripts, nothing fetched) that
shows a search result at a glance: headline, memory per stage, a layer map, micro-batch time per stage, search counts.
"""

from __future__ import annotations

import math
import os
from html import escape
from pathlib import Path

from galva_schema import DataParallelType, Strategy, write_text_atomic
from galva_search.search import SearchResult
from galva_search.summary import vocab_label

# Colour-blind-friendly palette (Okabe-Ito), one colour per tp/sp degree; degrees beyond it cycle.
_TP_COLOURS = ("#56B4E9", "#009E73", "#E69F00", "#CC79A7", "#0072B2", "#D55E00", "#F0E442", "#999999")
_OK, _NEAR, _OVER = "#2E9E5B", "#E69F00", "#D1495B"
_COUNT_NAMES = {
    "tasks": "tasks tried",
    "solved": "solved",
    "infeasible": "infeasible (nothing fits)",
    "pruned_bound": "pruned by time bound",
    "pruned_memory": "pruned by memory bound",
    "dp_problems": "stage DPs run",
    "dp_reused": "stage DPs reused",
    "refined": "refined",
}

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1040px;
color:#222;background:#fafafa;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.sub{color:#666;font-size:13px;margin-bottom:14px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #ddd;border-radius:8px;padding:8px 12px;min-width:110px}
.card .k{font-size:11px;color:#777;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:18px;font-weight:600}
.card.main{border-color:#0072B2}.card.main .v{color:#0072B2;font-size:22px}
svg{background:#fff;border:1px solid #ddd;border-radius:8px;display:block}
svg text{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
table{border-collapse:collapse;background:#fff;font-size:14px}
td,th{border:1px solid #ddd;padding:4px 12px;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
.legend{display:flex;flex-wrap:wrap;gap:14px;align-items:center;font-size:13px;margin:8px 0}
.legend span{display:inline-flex;align-items:center;gap:5px}
"""


def tp_colour(degree: int) -> str:
    """Fill colour of a layer cell for a tp (or Ulysses) degree: 1, 2, 4, 8, ... take successive palette entries."""
    if degree < 1 or degree & (degree - 1):
        return _TP_COLOURS[-1]
    return _TP_COLOURS[min(degree.bit_length() - 1, len(_TP_COLOURS) - 1)]


def _memory_colour(mib: float, usable: float, budget: float) -> str:
    if mib > budget:
        return _OVER
    return _NEAR if mib > usable else _OK


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5 or 5 times a power of ten that is >= ``raw`` (grid spacing with round labels)."""
    if raw <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _card(key: str, value: str, main: bool = False) -> str:
    cls = "card main" if main else "card"
    return f'<div class="{cls}"><div class="k">{escape(key)}</div><div class="v">{escape(value)}</div></div>'


def _headline(result: SearchResult) -> str:
    s = result.strategy
    cards = [
        _card("iteration time", _fmt_time(result.iteration_time_s), main=True),
        _card("throughput", f"{result.throughput:.2f} samples/s", main=True),
        _card("devices", str(s.world_size)),
        _card("pp", str(s.pp)),
        _card("division", "/".join(str(n) for n in s.pp_division)),
        _card("schedule", s.pipeline_schedule.value),
        _card("global batch", str(s.global_batch_size)),
        _card("micro-batches × size", f"{s.num_micro_batches} × {s.micro_batch_size}"),
        _card("search time", f"{result.search_time_s:.2f} s"),
    ]
    sub = (f"{vocab_label(s)}; default dp type {s.default_dp_type.value}; precision {s.mixed_precision.value}"
           f"{'; Megatron-SP' if s.megatron_sp else ''}")
    return (f'<h1>galva-search plan</h1><div class="sub">{escape(sub)}</div>'
            f'<div class="cards" id="headline">{"".join(cards)}</div>')


def _memory_chart(result: SearchResult) -> str:
    """Vertical bars, one per stage, with the usable-budget and total-budget lines."""
    usable, budget = result.usable_memory_mib, result.memory_budget_mib
    mems = result.stage_memory_mib
    n = len(mems)
    width, height, left, top, bottom = 960, 300, 70, 20, 40
    plot_h = height - top - bottom
    top_mib = max([budget, usable, *mems]) * 1.08
    bar_slot = (width - left - 20) / max(n, 1)
    bar_w = min(90.0, bar_slot * 0.6)

    def y(mib: float) -> float:
        return top + plot_h * (1 - mib / top_mib)

    parts = [f'<svg id="memory-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'role="img" aria-label="memory per stage">']
    step = _nice_step(top_mib / 5)
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
        # the budget label goes below its line when the two lines are close, so the labels never overlap
        dy = 13 if label == "budget" and budget - usable < top_mib * 0.06 else -5
        parts.append(
            f'<g class="budget-line" data-kind="{label.split()[0]}" data-mib="{value:.0f}"><title>{label} '
            f'{value:.0f} MiB</title><line x1="{left}" x2="{width - 20}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
            f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="{dash}"/><text x="{width - 24}" '
            f'y="{y(value) + dy:.1f}" font-size="11" text-anchor="end" fill="{colour}">{label} {value:.0f} MiB'
            f'</text></g>'
        )
    parts.append(f'<line x1="{left}" x2="{width - 20}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#999"/></svg>')
    legend = (f'<div class="legend"><span><svg width="14" height="14"><rect width="14" height="14" fill="{_OK}"/>'
              f'</svg>within usable memory</span><span><svg width="14" height="14"><rect width="14" height="14" '
              f'fill="{_NEAR}"/></svg>in the reserve</span><span><svg width="14" height="14"><rect width="14" '
              f'height="14" fill="{_OVER}"/></svg>over budget</span></div>')
    return "".join(parts) + legend


def _layer_cell(s: Strategy, index: int, x: float, y: float, w: float, h: float) -> str:
    layer = s.layers[index]
    dp_type = s.layer_dp_type(index)
    label = s.layer_summary(index)
    parts = [
        f'<g class="layer-cell" data-layer="{index}" data-label="{escape(label)}" data-tp="{layer.tp}" '
        f'data-ulysses="{int(layer.ulysses)}" data-dp-type="{dp_type.value}" data-checkpoint="{int(layer.checkpoint)}">'
        f'<title>layer {index}: {escape(label)}</title>'
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{tp_colour(layer.tp)}" '
        f'stroke="#fff" stroke-width="1"/>'
    ]
    if layer.ulysses:
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="url(#ulysses)"/>')
    r = min(w * 0.4, h * 0.16)  # narrow cells (many layers per stage) still show a visible marker
    if dp_type is DataParallelType.ZERO3:
        parts.append(f'<circle cx="{x + w / 2:.1f}" cy="{y + h * 0.32:.1f}" r="{r:.1f}" fill="#222"/>')
    elif dp_type is DataParallelType.ZERO2:
        parts.append(f'<circle cx="{x + w / 2:.1f}" cy="{y + h * 0.32:.1f}" r="{r:.1f}" fill="#fff" stroke="#222" '
                     f'stroke-width="1.5"/>')
    if layer.checkpoint:
        parts.append(f'<rect x="{x + 2:.1f}" y="{y + h - 7:.1f}" width="{max(w - 4, 1):.1f}" height="4" '
                     f'fill="#222"/>')
    if w >= 22:
        parts.append(f'<text x="{x + w / 2:.1f}" y="{y + h * 0.72:.1f}" font-size="10" text-anchor="middle" '
                     f'fill="#222">{index}</text>')
    parts.append("</g>")
    return "".join(parts)


def _layer_map(result: SearchResult) -> str:
    s = result.strategy
    width, left, row_h, gap, top = 960, 70, 40, 8, 10
    per_row = max(s.pp_division)
    cell_w = (width - left - 20) / per_row
    height = top + s.pp * (row_h + gap) + 10
    parts = [f'<svg id="layer-map" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="layer map">'
             '<defs><pattern id="ulysses" width="6" height="6" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="2.5" height="6" fill="#fff" fill-opacity="0.7"/>'
             '</pattern></defs>']
    for stage in range(s.pp):
        y = top + stage * (row_h + gap)
        layers = s.stage_layers(stage)
        parts.append(f'<text x="{left - 8}" y="{y + row_h / 2 - 2:.1f}" font-size="12" text-anchor="end">'
                     f'stage {stage}</text><text x="{left - 8}" y="{y + row_h / 2 + 12:.1f}" font-size="10" '
                     f'text-anchor="end" fill="#777">{layers.start}–{layers.stop - 1}</text>')
        for k, index in enumerate(s.stage_layers(stage)):
            parts.append(_layer_cell(s, index, left + k * cell_w, y, cell_w, row_h))
    parts.append("</svg>")
    return "".join(parts) + _layer_legend(s)


def _legend_swatch(body: str, text: str, kind: str) -> str:
    return (f'<span class="legend-item" data-kind="{kind}"><svg width="22" height="18" viewBox="0 0 22 18">{body}'
            f'</svg>{escape(text)}</span>')


def _layer_legend(s: Strategy) -> str:
    degrees = sorted({layer.tp for layer in s.layers})
    items = [_legend_swatch(f'<rect width="22" height="18" fill="{tp_colour(d)}"/>', f"tp/sp {d}", f"tp-{d}")
             for d in degrees]
    stripes = ('<defs><pattern id="ulysses-legend" width="6" height="6" patternUnits="userSpaceOnUse" '
               'patternTransform="rotate(45)"><rect width="2.5" height="6" fill="#fff" fill-opacity="0.7"/>'
               '</pattern></defs><rect width="22" height="18" fill="#999"/>'
               '<rect width="22" height="18" fill="url(#ulysses-legend)"/>')
    items += [
        _legend_swatch(stripes, "Ulysses sp (stripes)", "ulysses"),
        _legend_swatch('<rect width="22" height="18" fill="#ddd"/><circle cx="11" cy="9" r="4" fill="#fff" '
                       'stroke="#222" stroke-width="1.5"/>', "ZeRO-2", "zero2"),
        _legend_swatch('<rect width="22" height="18" fill="#ddd"/><circle cx="11" cy="9" r="4" fill="#222"/>',
                       "ZeRO-3 (FSDP)", "zero3"),
        _legend_swatch('<rect width="22" height="18" fill="#ddd"/><rect x="2" y="12" width="18" height="4" '
                       'fill="#222"/>', "activation checkpointing", "checkpoint"),
    ]
    note = "no marker: DDP; hover a cell for its compact plan"
    return f'<div class="legend" id="layer-legend">{"".join(items)}<span>{escape(note)}</span></div>'


def _time_chart(result: SearchResult) -> str:
    """Horizontal bars of the time per micro-batch of every stage; the slowest (the pipeline's pace) is marked."""
    times = result.stage_time_s
    width, left, bar_h, gap, top = 960, 70, 24, 8, 10
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


def _counts_table(result: SearchResult) -> str:
    keys = [k for k in _COUNT_NAMES if k in result.counts] + sorted(k for k in result.counts if k not in _COUNT_NAMES)
    rows = "".join(f'<tr><td>{escape(_COUNT_NAMES.get(k, k.replace("_", " ")))}</td><td class="n">'
                   f'{result.counts[k]}</td></tr>' for k in keys)
    rows += f'<tr><td>search time</td><td class="n">{result.search_time_s:.2f} s</td></tr>'
    return f'<table id="search-counts"><tr><th>search log</th><th>count</th></tr>{rows}</table>'


def html_report(result: SearchResult) -> str:
    """The whole page as one string (UTF-8, no external references)."""
    s = result.strategy
    title = f"galva-search: {s.world_size} devices, pp {s.pp}, {result.throughput:.2f} samples/s"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
        f"{_headline(result)}"
        "<h2>Memory per stage</h2>"
        f"{_memory_chart(result)}"
        "<h2>Layer map</h2>"
        f"{_layer_map(result)}"
        "<h2>Time per micro-batch</h2>"
        f"{_time_chart(result)}"
        "<h2>Search</h2>"
        f"{_counts_table(result)}"
        "</body></html>\n"
    )


def write_html_report(path: str | os.PathLike[str], result: SearchResult) -> Path:
    """Write :func:`html_report` to ``path`` atomically (never half-written)."""
    return write_text_atomic(path, html_report(result))
