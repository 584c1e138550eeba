"""The training charts: step records as ``galva-train --metrics-jsonl`` writes them (loss, learning rate, grad norm,
throughput, step time, TFLOP/s and peak memory by step), and the facts read off them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from galva_search.report.svg import fmt, nice_ticks

_LINE_W, _LINE_H = 640, 260
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 16, 12, 42
_MAX_MARKERS = 2000  # hover markers beyond this are thinned (every k-th) so huge runs stay small
_SMOOTHING = 0.9  # EMA weight of the smoothed loss, TensorBoard's default, bias-corrected


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


def series(records: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
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


def steady(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Median of ``key`` without the first step (allocation, warm-up) when there are others."""
    vals = [v for _, v in series(records, key)]
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
    loss = [v for _, v in series(records, "loss")]
    if loss:
        last = str(diverged.get("loss")) if diverged is not None else fmt(loss[-1])
        facts["loss (first / last / min)"] = f"{fmt(loss[0])} / {last} / {fmt(min(loss))}"
    for key, label in (
        ("tokens_per_s", "median tokens/s"),
        ("step_time_s", "median step time (s)"),
        ("tflops", "median TFLOP/s per rank"),
    ):
        value = steady(records, key)
        if value is not None:
            facts[label] = fmt(value)
    mem = [v for _, v in series(records, "peak_memory_mib")]
    if mem:
        facts["peak memory (MiB)"] = fmt(max(mem))
    return facts


def training_charts(records: Sequence[Mapping[str, Any]]) -> str:
    steps = [float(r["step"]) for r in records]
    x_ticks = nice_ticks(min(steps), max(steps), count=8)
    figures, missing = [], []
    for chart in CHARTS:
        points = series(records, chart.key)
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


def _line_chart(chart: Chart, points: list[tuple[float, float]], x_ticks: list[float]) -> str:
    y_ticks = nice_ticks(min(v for _, v in points), max(v for _, v in points))
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
        parts.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{fmt(t)}</text>')
    for t in x_ticks:
        x = sx(t)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP + ph}" y2="{_TOP + ph + 4}" class="axis"/>')
        parts.append(f'<text x="{x:.1f}" y="{_TOP + ph + 17}" class="tick" text-anchor="middle">{fmt(t)}</text>')
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
            f"<title>step {int(x)}: {escape(chart.hover.format(v=fmt(y)))}</title></circle>"
        )
    parts.append("</svg>")
    return "".join(parts)
