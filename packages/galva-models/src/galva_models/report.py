"""Training report: a ``--metrics-jsonl`` file as ONE self-contained HTML page of inline SVG line charts.

    galva-report metrics.jsonl -o report.html

The page has no scripts and no external assets (it opens offline and can be attached to an issue): one chart per
metric (loss with a smoothed line, learning rate, grad norm, tokens/s, step time, TFLOP/s, peak memory), axes with
ticks and labels, a hover title on every point, and a header with run facts. ``galva-train --report-html PATH``
writes the same page at the end of training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from galva_schema import write_text_atomic

__all__ = ["CHARTS", "ReportError", "load_metrics", "main", "render_report", "write_report"]


class ReportError(ValueError):
    """A missing or malformed metrics file; the message is one line naming the file (and line)."""


@dataclass(frozen=True)
class Chart:
    """One chart: the record key it plots, its title, the y-axis label and the hover text (``{v}``: the value)."""

    key: str
    title: str
    unit: str
    hover: str
    color: str


CHARTS: tuple[Chart, ...] = (
    Chart("loss", "Loss", "loss", "loss {v}", "#1f77b4"),
    Chart("lr", "Learning rate", "lr", "lr {v}", "#2ca02c"),
    Chart("grad_norm", "Grad norm", "grad norm", "grad norm {v}", "#d62728"),
    Chart("tokens_per_s", "Throughput", "tokens/s", "{v} tokens/s", "#9467bd"),
    Chart("step_time_s", "Step time", "s", "{v} s", "#8c564b"),
    Chart("tflops", "Model TFLOP/s per rank", "TFLOP/s", "{v} TFLOP/s", "#e377c2"),
    Chart("peak_memory_mib", "Peak memory", "MiB", "{v} MiB", "#ff7f0e"),
)

# chart geometry (SVG user units); the SVG scales to the page width
_W, _H = 640, 260
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 16, 12, 42
_MAX_MARKERS = 2000  # hover markers beyond this are thinned (every k-th) so huge runs stay small
_SMOOTHING = 0.9  # EMA weight of the smoothed loss, TensorBoard's default, bias-corrected


# ----------------------------------------------------------------------------------------------------- reading
def load_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a metrics JSONL file: one JSON object with an integer ``step`` per non-blank line.

    Raises :class:`ReportError` with one line ``PATH:LINE: what is wrong`` (or ``PATH: ...`` for the whole file).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ReportError(f"{p}: cannot read ({type(err).__name__}: {err})".splitlines()[0]) from None
    records: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportError(f"{p}:{lineno}: not JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict):
            raise ReportError(f"{p}:{lineno}: expected a JSON object, got {type(record).__name__}")
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ReportError(f"{p}:{lineno}: 'step' must be an integer, got {step!r}")
        for key, value in record.items():
            if value is not None and not isinstance(value, (int, float, str, bool)):
                raise ReportError(f"{p}:{lineno}: '{key}' must be a number, got {type(value).__name__}")
        records.append(record)
    if not records:
        raise ReportError(f"{p}: no step records")
    return records


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


# ----------------------------------------------------------------------------------------------------- drawing
def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k) covering ``[lo, hi]``."""
    if hi <= lo:
        pad = abs(lo) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
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


def _chart_svg(chart: Chart, points: list[tuple[float, float]], x_ticks: list[float]) -> str:
    y_ticks = _nice_ticks(min(v for _, v in points), max(v for _, v in points))
    x0, x1 = x_ticks[0], x_ticks[-1]
    y0, y1 = y_ticks[0], y_ticks[-1]
    pw, ph = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def sx(x: float) -> float:
        return _LEFT + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return _TOP + ph - (y - y0) / (y1 - y0) * ph

    parts = [
        f'<svg viewBox="0 0 {_W} {_H}" role="img" aria-label="{escape(chart.title)} by step">',
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
    parts.append(f'<text x="{_LEFT + pw / 2}" y="{_H - 6}" class="label" text-anchor="middle">step</text>')
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


def _summary(records: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Facts read off the records themselves."""
    facts: dict[str, str] = {"steps": str(len(records))}
    loss = [v for _, v in _series(records, "loss")]
    if loss:
        facts["loss (first / last / min)"] = f"{_fmt(loss[0])} / {_fmt(loss[-1])} / {_fmt(min(loss))}"
    # the first step includes warm-up (allocation, compilation), so steady-state numbers skip it when they can
    for key, label in (
        ("tokens_per_s", "median tokens/s"),
        ("step_time_s", "median step time (s)"),
        ("tflops", "median TFLOP/s per rank"),
    ):
        vals = [v for _, v in _series(records, key)]
        vals = sorted(vals[1:] if len(vals) > 1 else vals)
        if vals:
            facts[label] = _fmt(vals[len(vals) // 2])
    mem = [v for _, v in _series(records, "peak_memory_mib")]
    if mem:
        facts["peak memory (MiB)"] = _fmt(max(mem))
    return facts


_CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 8px}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:2px 16px;margin:0 0 16px}
dl.facts dt{color:#666}dl.facts dd{margin:0;font-variant-numeric:tabular-nums}
.grid-charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));gap:16px}
figure.chart{margin:0;border:1px solid #ddd;border-radius:6px;padding:8px}
figcaption{font-weight:600;margin:0 0 4px}figcaption small{font-weight:400;color:#666}
svg{width:100%;height:auto;display:block}
.plot{fill:#fafafa}.grid{stroke:#e4e4e4;stroke-width:1}.axis{stroke:#555;stroke-width:1}
.tick{font-size:11px;fill:#444}.label{font-size:12px;fill:#222}
.line{fill:none;stroke-width:1.5}.line.raw{stroke-opacity:.35}.line.smooth{stroke-width:2.2}
.pt{stroke:#fff;stroke-width:.5}.pt.hidden{fill-opacity:0;stroke:none}.pt:hover{fill-opacity:1;r:5}
p.empty{color:#666}
"""


def render_report(
    records: Sequence[Mapping[str, Any]], facts: Mapping[str, Any] | None = None, title: str = "Galva training report"
) -> str:
    """The HTML page for step ``records`` (dicts as galva-train logs them); ``facts`` go first in the header."""
    if not records:
        raise ReportError("no step records to report")
    all_facts: dict[str, str] = {str(k): str(v) for k, v in (facts or {}).items() if v is not None}
    for k, v in _summary(records).items():
        all_facts.setdefault(k, v)
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
            f"<figcaption>{escape(chart.title)}{note}</figcaption>{_chart_svg(chart, points, x_ticks)}</figure>"
        )
    facts_html = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in all_facts.items())
    empty = f'<p class="empty">No values logged for: {escape(", ".join(missing))}.</p>' if missing else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
        f'<h1>{escape(title)}</h1><dl class="facts">{facts_html}</dl>'
        f'<div class="grid-charts">{"".join(figures)}</div>{empty}</body></html>\n'
    )


def write_report(
    path: str | os.PathLike[str],
    records: Sequence[Mapping[str, Any]],
    facts: Mapping[str, Any] | None = None,
    title: str = "Galva training report",
) -> Path:
    """Render and write the page to ``path`` atomically (temporary file in the same directory, then rename)."""
    text = render_report(records, facts, title)
    return write_text_atomic(path, text)


# ---------------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """``galva-report METRICS.jsonl -o report.html``: exit 0, or 2 with one line ``galva-report: error: ...``."""
    p = argparse.ArgumentParser(prog="galva-report", description="Plot a galva-train --metrics-jsonl file as HTML.")
    p.add_argument("metrics", help="metrics JSONL file written by galva-train --metrics-jsonl")
    p.add_argument("-o", "--output", help="HTML file to write (default: METRICS with the suffix .html)")
    p.add_argument("--title", default=None, help="page title (default: 'Galva training report: METRICS')")
    args = p.parse_args(argv)
    src = Path(args.metrics)
    out = Path(args.output) if args.output else src.with_suffix(".html")
    if out.resolve() == src.resolve():
        print(f"galva-report: error: output {out} would overwrite the metrics file", file=sys.stderr)
        return 2
    try:
        records = load_metrics(src)
        write_report(out, records, {"metrics file": str(src)}, args.title or f"Galva training report: {src.name}")
    except ReportError as err:
        print(f"galva-report: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"galva-report: error: cannot write {out}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(f"galva-report: wrote {out} ({len(records)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
