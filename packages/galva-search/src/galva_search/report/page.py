"""The whole page: a self-contained HTML file (inline CSS and SVG, no scripts, nothing fetched) for a search, a
training run, or both."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from galva_schema import write_text_atomic
from galva_search.options import SearchResult
from galva_search.report.measured import measured_vs_predicted
from galva_search.report.plan import PlanFacts, ReportError
from galva_search.report.plan_charts import counts_table, headline, memory_chart, time_breakdown, time_chart
from galva_search.report.plan_map import layer_map
from galva_search.report.style import CSS
from galva_search.report.training import training_charts, training_facts
from galva_search.summary import vocab_label


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
        body.append(f'<div class="sub">{escape(sub)}</div>{headline(plan)}')
    if all_facts:
        body.append('<dl class="facts">' + "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>"
                                                  for k, v in all_facts.items()) + "</dl>")
    if plan is not None:
        body += [
            f'<section id="plan"><h2>Layer plan</h2>{layer_map(plan)}</section>',
            f'<section id="memory"><h2>Predicted memory per stage</h2>{memory_chart(plan)}</section>',
            f'<section id="time"><h2>Predicted time of one iteration</h2>{time_breakdown(plan)}'
            f'<h2>Time per micro-batch, per stage</h2>{time_chart(plan)}</section>',
        ]
    if records:
        body.append(f'<section id="training"><h2>Training</h2>{training_charts(records)}</section>')
        if plan is not None:
            body.append(f'<section id="measured"><h2>Measured against predicted</h2>'
                        f'{measured_vs_predicted(plan, records)}</section>')
    if plan is not None and plan.summary.counts.tasks:
        body.append(f'<section id="search"><h2>Search</h2>{counts_table(plan)}</section>')
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>{''.join(body)}</body></html>\n"
    )


def write_page(path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Write :func:`render_page` (same keyword arguments) to ``path`` atomically (never half-written)."""
    return write_text_atomic(path, render_page(**kwargs))


def html_report(result: SearchResult) -> str:
    """The ``galva-search --report-html`` page of a search result."""
    s = result.strategy
    throughput = result.summary.throughput_samples_per_s
    return render_page(PlanFacts(s, result.summary),
                       title=f"galva-search: {s.world_size} devices, pp {s.pp}, {throughput:.2f} samples/s")


def write_html_report(path: str | os.PathLike[str], result: SearchResult) -> Path:
    """Write :func:`html_report` to ``path`` atomically (never half-written)."""
    return write_text_atomic(path, html_report(result))
