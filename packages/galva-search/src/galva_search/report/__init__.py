"""Galva's one report page: a self-contained HTML file (inline CSS and SVG, no scripts, nothing fetched) for a
search, a training run, or both.

* plan (:class:`PlanFacts`: a strategy and the :class:`galva_schema.SearchSummary` galva-search wrote with it):
  headline numbers, the per-layer plan as a picture (:mod:`.plan_map`), predicted memory per stage against the
  budget, the predicted time of an iteration by kind and per stage, the search counts (:mod:`.plan_charts`);
* training (step records as ``galva-train --metrics-jsonl`` writes them): loss, learning rate, grad norm,
  throughput, step time, TFLOP/s and peak memory by step (:mod:`.training`);
* both: measured against predicted step time, throughput and memory (:mod:`.measured`).

``galva-search --report-html`` writes the plan page, ``galva-train --report-html`` and ``galva-report`` the
training page (``galva-report --strategy --summary`` both); :mod:`.page` puts a page together, :mod:`.style` holds
its look and :mod:`.svg` the small pieces every figure uses. This package lives in galva-search because the planner
must stay free of torch; galva-models imports it. Plain SVG, no plotting library: nothing to install, nothing to
fetch, identical output everywhere.
"""

from galva_search.report.page import html_report, render_page, write_html_report, write_page
from galva_search.report.plan import PlanFacts, ReportError
from galva_search.report.style import tp_colour
from galva_search.report.training import CHARTS, Chart, training_facts

__all__ = [
    "CHARTS",
    "Chart",
    "PlanFacts",
    "ReportError",
    "html_report",
    "render_page",
    "tp_colour",
    "training_facts",
    "write_html_report",
    "write_page",
]
