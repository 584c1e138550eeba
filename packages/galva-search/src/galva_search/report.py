"""Galva's one report page: a self-contained HTML file (inline CSS and SVG, no scripts, nothing fetched) for a
search, a training run, or both.

* plan (``PlanFacts``, from a :class:`SearchResult` or from a strategy file + ``--summary-json``): headline numbers,
  the per-layer plan as a picture (one row per stage, one cell per layer: colour = tp/sp degree, stripes = Ulysses,
  dot = ZeRO-2/ZeRO-3, bar = checkpointing), predicted memory per stage against the budget, the predicted time of an
  iteration by kind (compute, tp, dp, p2p, re-sharding, pipeline bubble) and per stage, the search counts;
* training (step records as ``galva-train --metrics-jsonl`` writes them): loss, learning rate, grad norm,
  throughput, step time, TFLOP/s and peak memory by step;
* both: measured against predicted step time, throughput and memory.

``galva-search --report-html`` writes the plan page, ``galva-train --report-html`` and ``galva-report`` the
training page (``galva-report --strategy --summary`` both). This module lives in galva-search because the planner
must stay free of torch; galva-models imports it. Plain SVG, no plotting library: nothing to install, nothing to
fetch, identical output everywhere.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from galva_schema import DataParallelType, Strategy, write_text_atomic
from galva_search.options import SearchResult
from galva_search.summary import vocab_label

__all__ = [
    "CHARTS",
    "Chart",
    "PlanFacts",
    "ReportError",
    "html_report",
    "render_page",
    "tp_colour",
    "write_html_report",
    "write_page",
]


class ReportError(ValueError):
    """Nothing to report, or a malformed input; the message is one line."""


@dataclass(frozen=True)
class PlanFacts:
    """What the page shows of a plan: the strategy and its predicted cost (the fields of a search summary)."""

    strategy: Strategy
    iteration_time_s: float
    throughput: float  # samples per second
    stage_memory_mib: list[float]
    stage_time_s: list[float]  # per micro-batch
    memory_budget_mib: float
    usable_memory_mib: float
    time_breakdown_s: dict[str, float] = field(default_factory=dict)
    search_time_s: float | None = None
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_result(cls, result: SearchResult) -> PlanFacts:
        return cls(
            result.strategy, result.iteration_time_s, result.throughput, list(result.stage_memory_mib),
            list(result.stage_time_s), result.memory_budget_mib, result.usable_memory_mib,
            dict(result.time_breakdown_s), result.search_time_s, dict(result.counts),
        )

    @classmethod
    def from_summary(
        cls, strategy: Strategy, summary: Mapping[str, Any], source: str = "summary", strategy_source: str = "strategy"
    ) -> PlanFacts:
        """From a ``galva-search --summary-json`` dict (``kind: galva.search_summary``) and its strategy; a summary
        written for another plan (another model's layer count, another division or batch) is refused."""
        if summary.get("kind") != "galva.search_summary":
            raise ReportError(f"{source}: kind {summary.get('kind')!r} is not a galva-search summary (--summary-json)")
        mismatch = _summary_mismatch(strategy, summary)
        if mismatch is not None:
            raise ReportError(
                f"{source}: {mismatch} in {strategy_source}: the summary of another plan; give the --summary-json "
                f"galva-search wrote with this strategy"
            )
        try:
            return cls(
                strategy,
                float(summary["iteration_time_s"]),
                float(summary["throughput_samples_per_s"]),
                [float(m) for m in summary["stage_memory_mib"]],
                [float(t) for t in summary["stage_micro_batch_time_s"]],
                float(summary["memory_budget_mib"]),
                float(summary["usable_memory_mib"]),
                {str(k): float(v) for k, v in summary.get("time_breakdown_s", {}).items()},
                float(summary["search_time_s"]) if summary.get("search_time_s") is not None else None,
                {str(k): int(v) for k, v in summary.get("counts", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ReportError(f"{source}: {type(err).__name__}: {err}") from None


def _summary_mismatch(strategy: Strategy, summary: Mapping[str, Any]) -> str | None:
    """The first plan fact of a search summary that its strategy contradicts, as ``key X, but Y``; None if none."""
    division = summary.get("pp_division")
    layers = sum(division) if isinstance(division, list) and all(isinstance(n, int) for n in division) else None
    if layers is not None and layers != strategy.num_layers:
        return f"pp_division {division} plans {layers} layers, but the model has {strategy.num_layers}"
    facts = {
        "pp_division": list(strategy.pp_division),
        "pp": strategy.pp,
        "virtual_stages": strategy.virtual_stages,
        "pipeline_schedule": strategy.pipeline_schedule.value,
        "global_batch_size": strategy.global_batch_size,
        "num_micro_batches": strategy.num_micro_batches,
    }
    for key, value in facts.items():
        if key in summary and summary[key] != value:
            return f"{key} is {summary[key]!r}, but {value!r}"
    return None


@dataclass(frozen=True)
class Chart:
    """One training chart: the record key it plots, its title, the y-axis label, the hover text, its colour."""

    key: str
    title: str
    unit: str
    hover: str
    color: str


CHARTS: tuple[Chart, ...] = (
    Chart("loss", "Loss", "loss", "loss {v}", "#0072B2"),
    Chart("tokens_per_s", "Throughput", "tokens/s", "{v} tokens/s", "#009E73"),
    Chart("lr", "Learning rate", "lr", "lr {v}", "#56B4E9"),
    Chart("grad_norm", "Grad norm", "grad norm", "grad norm {v}", "#D55E00"),
    Chart("step_time_s", "Step time", "s", "{v} s", "#CC79A7"),
    Chart("tflops", "Model TFLOP/s per rank", "TFLOP/s", "{v} TFLOP/s", "#E69F00"),
    Chart("peak_memory_mib", "Peak memory", "MiB", "{v} MiB", "#999999"),
)

# Colour-blind-friendly palette (Okabe-Ito), one colour per tp/sp degree; degrees beyond it cycle.
_TP_COLOURS = ("#56B4E9", "#009E73", "#E69F00", "#CC79A7", "#0072B2", "#D55E00", "#F0E442", "#999999")
_OK, _NEAR, _OVER = "#2E9E5B", "#E69F00", "#D1495B"
_PREDICTED, _MEASURED = "#8FB8DE", "#0072B2"
_TIME_PARTS = {  # kind: (label, colour)
    "compute": ("compute", "#0072B2"),
    "tp": ("tp / sp collectives", "#E69F00"),
    "dp": ("dp: gradient sync, ZeRO-3 gathers", "#009E73"),
    "p2p": ("pipeline p2p", "#CC79A7"),
    "redistribution": ("re-sharding between layers", "#F0E442"),
    "bubble": ("pipeline bubble", "#BBBBBB"),
}
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
_WIDTH = 960  # every plan figure; training charts are 640 wide, two per row
_LINE_W, _LINE_H = 640, 260
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 16, 12, 42
_MAX_MARKERS = 2000  # hover markers beyond this are thinned (every k-th) so huge runs stay small
_SMOOTHING = 0.9  # EMA weight of the smoothed loss, TensorBoard's default, bias-corrected

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1040px;
color:#222;background:#fafafa;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.sub{color:#666;font-size:13px;margin-bottom:14px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #ddd;border-radius:8px;padding:8px 12px;min-width:110px}
.card .k{font-size:11px;color:#777;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:18px;font-weight:600}
.card.main{border-color:#0072B2}.card.main .v{color:#0072B2;font-size:22px}
svg{background:#fff;border:1px solid #ddd;border-radius:8px;display:block;max-width:100%;height:auto}
svg text{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
table{border-collapse:collapse;background:#fff;font-size:14px;margin:8px 0}
td,th{border:1px solid #ddd;padding:4px 12px;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
.legend{display:flex;flex-wrap:wrap;gap:14px;align-items:center;font-size:13px;margin:8px 0}
.legend span{display:inline-flex;align-items:center;gap:5px}
.legend svg{border:0;background:none}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:2px 16px;margin:0 0 16px}
dl.facts dt{color:#666}dl.facts dd{margin:0;font-variant-numeric:tabular-nums}
.grid-charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));gap:16px}
figure.chart{margin:0;border:1px solid #ddd;border-radius:8px;padding:8px;background:#fff}
figure.chart svg{border:0;width:100%}
figcaption{font-weight:600;margin:0 0 4px}figcaption small{font-weight:400;color:#666}
.plot{fill:#fafafa}.grid{stroke:#e4e4e4;stroke-width:1}.axis{stroke:#555;stroke-width:1}
.tick{font-size:11px;fill:#444}.label{font-size:12px;fill:#222}
.line{fill:none;stroke-width:1.5}.line.raw{stroke-opacity:.35}.line.smooth{stroke-width:2.2}
.pt{stroke:#fff;stroke-width:.5}.pt.hidden{fill-opacity:0;stroke:none}.pt:hover{fill-opacity:1;r:5}
p.empty,p.note{color:#666}
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


def _headline(plan: PlanFacts) -> str:
    s = plan.strategy
    cards = [
        _card("iteration time", _fmt_time(plan.iteration_time_s), main=True),
        _card("throughput", f"{plan.throughput:.2f} samples/s", main=True),
        _card("devices", str(s.world_size)),
        _card("pp", str(s.pp)),
        _card("division", "/".join(str(n) for n in s.pp_division)),
        _card("schedule", s.pipeline_schedule.value + (f" × {s.virtual_stages}" if s.virtual_stages > 1 else "")),
        _card("global batch", str(s.global_batch_size)),
        _card("micro-batches × size", f"{s.num_micro_batches} × {s.micro_batch_size}"),
    ]
    if plan.search_time_s is not None:
        cards.append(_card("search time", f"{plan.search_time_s:.2f} s"))
    return f'<div class="cards" id="headline">{"".join(cards)}</div>'


_LINE_LABEL_PX = 11
"""Font size of the memory chart's usable / budget labels."""


def _memory_chart(plan: PlanFacts) -> str:
    """Vertical bars, one per stage, with the usable-budget and total-budget lines."""
    usable, budget = plan.usable_memory_mib, plan.memory_budget_mib
    mems = plan.stage_memory_mib
    n = len(mems)
    width, height, left, top, bottom = _WIDTH, 300, 70, 20, 40
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


def _layer_map(plan: PlanFacts) -> str:
    s = plan.strategy
    width, left, row_h, gap, top = _WIDTH, 70, 40, 8, 10
    per_row = max(len(s.stage_layers(stage)) for stage in range(s.pp))
    cell_w = (width - left - 20) / per_row
    height = top + s.pp * (row_h + gap) + 10
    parts = [f'<svg id="layer-map" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="layer map">'
             '<defs><pattern id="ulysses" width="6" height="6" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="2.5" height="6" fill="#fff" fill-opacity="0.7"/>'
             '</pattern></defs>']
    for stage in range(s.pp):
        y = top + stage * (row_h + gap)
        runs = ", ".join(f"{r.start}–{r.stop - 1}" for r in (s.chunk_layers(c) for c in s.stage_chunks(stage)))
        parts.append(f'<text x="{left - 8}" y="{y + row_h / 2 - 2:.1f}" font-size="12" text-anchor="end">'
                     f'stage {stage}</text><text x="{left - 8}" y="{y + row_h / 2 + 12:.1f}" font-size="10" '
                     f'text-anchor="end" fill="#777">{runs}</text>')
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


def _time_chart(plan: PlanFacts) -> str:
    """Horizontal bars of the time per micro-batch of every stage; the slowest (the pipeline's pace) is marked."""
    times = plan.stage_time_s
    width, left, bar_h, gap, top = _WIDTH, 70, 24, 8, 10
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


def _counts_table(plan: PlanFacts) -> str:
    keys = [k for k in _COUNT_NAMES if k in plan.counts] + sorted(k for k in plan.counts if k not in _COUNT_NAMES)
    rows = "".join(f'<tr><td>{escape(_COUNT_NAMES.get(k, k.replace("_", " ")))}</td><td class="n">'
                   f'{plan.counts[k]}</td></tr>' for k in keys)
    if plan.search_time_s is not None:
        rows += f'<tr><td>search time</td><td class="n">{plan.search_time_s:.2f} s</td></tr>'
    return f'<table id="search-counts"><tr><th>search log</th><th>count</th></tr>{rows}</table>'




def _swatch(colour: str) -> str:
    return f'<svg width="14" height="14"><rect width="14" height="14" fill="{colour}"/></svg>'


def _time_breakdown(plan: PlanFacts) -> str:
    """One stacked bar: the iteration split by kind (PlanCost.time_breakdown_s), with a table of the numbers."""
    parts = [(k, v) for k, v in plan.time_breakdown_s.items() if v > 0]
    if not parts:
        return '<p class="note">No time breakdown in this summary (written by an older galva-search).</p>'
    total = sum(v for _, v in parts)
    width, left, height, bar_h = _WIDTH, 20, 70, 34
    scale = (width - 2 * left) / total
    svg = [f'<svg id="time-breakdown" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="predicted time of one iteration by kind">']
    x = float(left)
    for kind, seconds in parts:
        label, colour = _TIME_PARTS.get(kind, (kind, "#999999"))
        w = seconds * scale
        share = 100 * seconds / total
        svg.append(f'<g class="time-part" data-kind="{escape(kind)}" data-s="{seconds:.9g}"><title>{escape(label)}: '
                   f'{_fmt_time(seconds)} ({share:.1f}%)</title><rect x="{x:.1f}" y="10" width="{max(w, 0.5):.1f}" '
                   f'height="{bar_h}" fill="{colour}"/>')
        if w > 60:
            svg.append(f'<text x="{x + w / 2:.1f}" y="{10 + bar_h / 2 + 4}" font-size="12" text-anchor="middle" '
                       f'fill="#222">{share:.0f}%</text>')
        svg.append("</g>")
        x += w
    svg.append(f'<text x="{left}" y="{height - 8}" font-size="11" fill="#777">0</text><text x="{width - left}" '
               f'y="{height - 8}" font-size="11" fill="#777" text-anchor="end">{_fmt_time(total)} per iteration'
               f'</text></svg>')
    legend = "".join(f'<span>{_swatch(_TIME_PARTS.get(k, (k, "#999999"))[1])}{escape(_TIME_PARTS.get(k, (k,))[0])}'
                     f'</span>' for k, _ in parts)
    rows = "".join(f'<tr><td>{escape(_TIME_PARTS.get(k, (k,))[0])}</td><td class="n">{_fmt_time(v)}</td>'
                   f'<td class="n">{100 * v / total:.1f}%</td></tr>' for k, v in parts)
    return (f'{"".join(svg)}<div class="legend">{legend}</div><table id="time-table"><tr><th>kind</th>'
            f'<th>per iteration</th><th>share</th></tr>{rows}</table>')


# ------------------------------------------------------------------------------------------ training charts
def _series(records: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    """``(step, value)`` for every record whose ``key`` is a finite number (None, NaN and inf are gaps)."""
    out = []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append((float(r["step"]), float(v)))
    return out


def _smooth(values: Sequence[float], weight: float = _SMOOTHING) -> list[float]:
    """Bias-corrected exponential moving average (early points are not pulled towards zero)."""
    out, acc = [], 0.0
    for i, v in enumerate(values, start=1):
        acc = weight * acc + (1.0 - weight) * v
        out.append(acc / (1.0 - weight**i))
    return out


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 x 10^k) covering ``[lo, hi]``."""
    if hi <= lo:
        pad = abs(lo) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    step = _nice_step((hi - lo) / max(1, count))
    ticks, t = [], math.floor(lo / step) * step
    while t <= hi + step * 1e-9:
        ticks.append(round(t / step) * step)
        t += step
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + step)
    return ticks


def _fmt(v: float) -> str:
    """Compact number for ticks and hover titles."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6 or a < 1e-3:
        return f"{v:.3g}"
    if a >= 1000:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def _line_chart(chart: Chart, points: list[tuple[float, float]], x_ticks: list[float]) -> str:
    y_ticks = _nice_ticks(min(v for _, v in points), max(v for _, v in points))
    x0, x1 = x_ticks[0], x_ticks[-1]
    y0, y1 = y_ticks[0], y_ticks[-1]
    pw, ph = _LINE_W - _LEFT - _RIGHT, _LINE_H - _TOP - _BOTTOM

    def sx(x: float) -> float:
        return _LEFT + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return _TOP + ph - (y - y0) / (y1 - y0) * ph

    parts = [
        f'<svg viewBox="0 0 {_LINE_W} {_LINE_H}" role="img" aria-label="{escape(chart.title)} by step">',
        f'<rect x="{_LEFT}" y="{_TOP}" width="{pw}" height="{ph}" class="plot"/>',
    ]
    for t in y_ticks:
        y = sy(t)
        parts.append(f'<line x1="{_LEFT}" x2="{_LEFT + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_fmt(t)}</text>')
    for t in x_ticks:
        x = sx(t)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP + ph}" y2="{_TOP + ph + 4}" class="axis"/>')
        parts.append(f'<text x="{x:.1f}" y="{_TOP + ph + 17}" class="tick" text-anchor="middle">{_fmt(t)}</text>')
    parts.append(f'<line x1="{_LEFT}" x2="{_LEFT + pw}" y1="{_TOP + ph}" y2="{_TOP + ph}" class="axis"/>')
    parts.append(f'<line x1="{_LEFT}" x2="{_LEFT}" y1="{_TOP}" y2="{_TOP + ph}" class="axis"/>')
    parts.append(f'<text x="{_LEFT + pw / 2}" y="{_LINE_H - 6}" class="label" text-anchor="middle">step</text>')
    parts.append(
        f'<text x="14" y="{_TOP + ph / 2}" class="label" text-anchor="middle" '
        f'transform="rotate(-90 14 {_TOP + ph / 2})">{escape(chart.unit)}</text>'
    )
    raw_line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    if chart.key == "loss" and len(points) > 2:
        smooth = _smooth([v for _, v in points])
        smooth_line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for (x, _), y in zip(points, smooth))
        parts.append(f'<polyline points="{raw_line}" class="line raw" stroke="{chart.color}"/>')
        parts.append(f'<polyline points="{smooth_line}" class="line smooth" stroke="{chart.color}"/>')
    else:
        parts.append(f'<polyline points="{raw_line}" class="line" stroke="{chart.color}"/>')
    stride = max(1, math.ceil(len(points) / _MAX_MARKERS))
    visible = "" if len(points) <= 120 else " hidden"  # dense runs: markers only catch the hover
    for x, y in points[::stride]:
        parts.append(
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" class="pt{visible}" fill="{chart.color}">'
            f"<title>step {int(x)}: {escape(chart.hover.format(v=_fmt(y)))}</title></circle>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _steady(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Median of ``key`` without the first step (allocation, warm-up) when there are others."""
    vals = [v for _, v in _series(records, key)]
    vals = sorted(vals[1:] if len(vals) > 1 else vals)
    return vals[len(vals) // 2] if vals else None


def _non_finite(value: Any) -> bool:
    """A loss that is not a number: a float NaN/inf, or the strings galva-train's strict JSON writes for them."""
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, str) and value.strip().lower() in {"nan", "infinity", "-infinity", "inf", "-inf"}


def training_facts(records: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Facts read off the step records themselves."""
    facts: dict[str, str] = {}
    diverged = next((r for r in records if _non_finite(r.get("loss"))), None)
    if diverged is not None:  # first in the header: the curves and the numbers below end in a divergence
        facts["DIVERGED"] = f"loss is {diverged.get('loss')} at step {int(diverged['step'])}; the run diverged"
    facts["steps"] = str(len(records))
    loss = [v for _, v in _series(records, "loss")]
    if loss:
        last = str(diverged.get("loss")) if diverged is not None else _fmt(loss[-1])
        facts["loss (first / last / min)"] = f"{_fmt(loss[0])} / {last} / {_fmt(min(loss))}"
    for key, label in (
        ("tokens_per_s", "median tokens/s"),
        ("step_time_s", "median step time (s)"),
        ("tflops", "median TFLOP/s per rank"),
    ):
        value = _steady(records, key)
        if value is not None:
            facts[label] = _fmt(value)
    mem = [v for _, v in _series(records, "peak_memory_mib")]
    if mem:
        facts["peak memory (MiB)"] = _fmt(max(mem))
    return facts


def _training_charts(records: Sequence[Mapping[str, Any]]) -> str:
    steps = [float(r["step"]) for r in records]
    x_ticks = _nice_ticks(min(steps), max(steps), count=8)
    figures, missing = [], []
    for chart in CHARTS:
        points = _series(records, chart.key)
        if not points:
            missing.append(chart.key)
            continue
        note = " <small>(faint: per step, bold: smoothed)</small>" if chart.key == "loss" and len(points) > 2 else ""
        figures.append(
            f'<figure class="chart" id="chart-{chart.key}" data-metric="{chart.key}" data-points="{len(points)}">'
            f"<figcaption>{escape(chart.title)}{note}</figcaption>{_line_chart(chart, points, x_ticks)}</figure>"
        )
    empty = f'<p class="empty">No values logged for: {escape(", ".join(missing))}.</p>' if missing else ""
    return f'<div class="grid-charts">{"".join(figures)}</div>{empty}'


def _measured_vs_predicted(plan: PlanFacts, records: Sequence[Mapping[str, Any]]) -> str:
    """Pairs of bars (predicted, measured): iteration time, throughput, and the peak memory of stage 0 (rank 0 logs
    the metrics); a ratio column says how far apart they are."""
    rows: list[tuple[str, str, float, float | None, str]] = []  # kind, label, predicted, measured, unit
    step_time = _steady(records, "step_time_s")
    rows.append(("step_time", "step time", plan.iteration_time_s, step_time, "s"))
    samples = plan.strategy.global_batch_size / step_time if step_time else None
    rows.append(("throughput", "throughput", plan.throughput, samples, "samples/s"))
    mem = [v for _, v in _series(records, "peak_memory_mib")]
    stage0 = plan.stage_memory_mib[0] if plan.stage_memory_mib else math.nan
    rows.append(("memory", "peak memory, stage 0", stage0, max(mem) if mem else None, "MiB"))
    width, left, row_h, top = _WIDTH, 170, 46, 10
    height = top + len(rows) * row_h + 10
    svg = [f'<svg id="measured-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="measured against predicted">']
    for i, (kind, label, predicted, measured, unit) in enumerate(rows):
        y = top + i * row_h
        top_value = max(v for v in (predicted, measured, 1e-12) if v is not None and math.isfinite(v))
        scale = (width - left - 200) / top_value
        svg.append(f'<text x="{left - 8}" y="{y + 20}" font-size="12" text-anchor="end">{escape(label)}</text>')
        for j, (which, value, colour) in enumerate((("predicted", predicted, _PREDICTED),
                                                    ("measured", measured, _MEASURED))):
            if value is None or not math.isfinite(value):
                continue
            yy = y + 4 + j * 17
            text = f"{_fmt(value)} {unit} {which}"
            svg.append(f'<g class="mvp-bar" data-kind="{kind}" data-which="{which}" data-value="{value:.6g}">'
                       f'<title>{escape(label)}: {escape(text)}</title><rect x="{left}" y="{yy}" '
                       f'width="{max(value * scale, 1):.1f}" height="15" fill="{colour}" rx="2"/>'
                       f'<text x="{left + value * scale + 6:.1f}" y="{yy + 12}" font-size="11">{escape(text)}</text>'
                       f'</g>')
    svg.append("</svg>")
    legend = (f'<div class="legend"><span>{_swatch(_PREDICTED)}predicted by galva-search</span>'
              f'<span>{_swatch(_MEASURED)}measured (median step without the first; memory: rank 0 high-water mark,'
              f' on a CPU the process\'s resident set)</span></div>')
    table = "".join(
        f'<tr><td>{escape(label)} ({unit})</td><td class="n">{_fmt(p)}</td><td class="n">'
        f'{_fmt(m) if m is not None else "–"}</td><td class="n">'
        f'{f"{m / p:.2f}×" if m is not None and p and math.isfinite(p) else "–"}</td></tr>'
        for _, label, p, m, unit in rows
    )
    return (f'{"".join(svg)}{legend}<table id="measured-table"><tr><th></th><th>predicted</th><th>measured</th>'
            f'<th>measured / predicted</th></tr>{table}</table>')


# ---------------------------------------------------------------------------------------------------- page
def render_page(
    plan: PlanFacts | None = None,
    records: Sequence[Mapping[str, Any]] | None = None,
    facts: Mapping[str, Any] | None = None,
    title: str | None = None,
) -> str:
    """The whole page as one string (UTF-8, no external references): the plan sections when ``plan`` is given, the
    training sections when ``records`` are, and measured against predicted when both are."""
    if plan is None and not records:
        raise ReportError("nothing to report: neither a plan nor step records")
    all_facts: dict[str, str] = {str(k): str(v) for k, v in (facts or {}).items() if v is not None}
    if records:
        for k, v in training_facts(records).items():
            all_facts.setdefault(k, v)
    if title is None:
        title = "Galva run report" if plan is not None and records else (
            "Galva training report" if records else "galva-search plan")
    body = [f"<h1>{escape(title)}</h1>"]
    if plan is not None:
        s = plan.strategy
        sub = (f"{vocab_label(s)}; default dp type {s.default_dp_type.value}; precision {s.mixed_precision.value}"
               f"{'; Megatron-SP' if s.megatron_sp else ''}")
        body.append(f'<div class="sub">{escape(sub)}</div>{_headline(plan)}')
    if all_facts:
        body.append('<dl class="facts">' + "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>"
                                                  for k, v in all_facts.items()) + "</dl>")
    if plan is not None:
        body += [
            f'<section id="plan"><h2>Layer plan</h2>{_layer_map(plan)}</section>',
            f'<section id="memory"><h2>Predicted memory per stage</h2>{_memory_chart(plan)}</section>',
            f'<section id="time"><h2>Predicted time of one iteration</h2>{_time_breakdown(plan)}'
            f'<h2>Time per micro-batch, per stage</h2>{_time_chart(plan)}</section>',
        ]
    if records:
        body.append(f'<section id="training"><h2>Training</h2>{_training_charts(records)}</section>')
        if plan is not None:
            body.append(f'<section id="measured"><h2>Measured against predicted</h2>'
                        f'{_measured_vs_predicted(plan, records)}</section>')
    if plan is not None and plan.counts:
        body.append(f'<section id="search"><h2>Search</h2>{_counts_table(plan)}</section>')
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>{''.join(body)}</body></html>\n"
    )


def write_page(path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Write :func:`render_page` (same keyword arguments) to ``path`` atomically (never half-written)."""
    return write_text_atomic(path, render_page(**kwargs))


def html_report(result: SearchResult) -> str:
    """The ``galva-search --report-html`` page of a search result."""
    s = result.strategy
    return render_page(PlanFacts.from_result(result),
                       title=f"galva-search: {s.world_size} devices, pp {s.pp}, {result.throughput:.2f} samples/s")


def write_html_report(path: str | os.PathLike[str], result: SearchResult) -> Path:
    """Write :func:`html_report` to ``path`` atomically (never half-written)."""
    return write_text_atomic(path, html_report(result))
