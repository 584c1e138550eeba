"""Training report: a ``--metrics-jsonl`` file as ONE self-contained HTML page of inline SVG line charts.

    galva-report metrics.jsonl -o report.html
    galva-report metrics.jsonl --strategy plan.json --summary summary.json -o report.html   # with the plan
    galva-report metrics.jsonl --strategy plan.json --summary summary.json --check check.json -o report.html

The page is galva-search's report (``galva_search.report``: one package and one look for the search, training and
whole-run pages): no scripts and no external assets, one chart per metric (loss with a smoothed line, tokens/s,
learning rate, grad norm, step time, TFLOP/s, peak memory), a header with run facts, and with ``--strategy`` and
``--summary`` also the plan, predicted memory and time, and measured against predicted (with ``--check``, the
``galva check`` file of the run: its measured base and peak, and each quantity's noise band). ``galva-train
--report-html PATH`` writes the training page at the end of training.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from galva_schema import RunCheck, SchemaError, SearchSummary, Strategy, write_text_atomic
from galva_search.report import CHARTS, PlanFacts, ReportError, render_page

__all__ = ["CHARTS", "ReportError", "load_metrics", "load_plan", "main", "render_report", "write_report"]


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
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines, start=1) if line.strip()), default=0)
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if lineno == last and not text.endswith("\n") and records:
                # the last line of a killed run, cut off mid-write: report the steps before it
                print(
                    f"galva-report: warning: {p}:{lineno}: incomplete last line skipped (a killed run?)",
                    file=sys.stderr,
                )
                break
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


def load_plan(
    strategy_path: str | os.PathLike[str],
    summary_path: str | os.PathLike[str],
    check_path: str | os.PathLike[str] | None = None,
) -> PlanFacts:
    """A strategy file and the ``galva-search --summary-json`` (a :class:`galva_schema.SearchSummary`) written with
    it, and optionally the ``galva check`` file of a run of it, as the report's plan facts; a bad file, or a summary
    of another plan, is one line."""
    try:
        strategy = Strategy.load(strategy_path)
        summary = SearchSummary.load(summary_path)
        check = RunCheck.load(check_path) if check_path is not None else None
    except (SchemaError, OSError) as err:
        raise ReportError(str(err).splitlines()[0]) from None
    plan = PlanFacts.matched(strategy, summary, str(summary_path), str(strategy_path))
    return replace(plan, check=check)


def render_report(
    records: Sequence[Mapping[str, Any]],
    facts: Mapping[str, Any] | None = None,
    title: str = "Galva training report",
    plan: PlanFacts | None = None,
) -> str:
    """The HTML page for step ``records`` (dicts as galva-train logs them); ``facts`` go first in the header."""
    if not records:
        raise ReportError("no step records to report")
    return render_page(plan=plan, records=records, facts=facts, title=title)


def write_report(
    path: str | os.PathLike[str],
    records: Sequence[Mapping[str, Any]],
    facts: Mapping[str, Any] | None = None,
    title: str = "Galva training report",
    plan: PlanFacts | None = None,
) -> Path:
    """Render and write the page to ``path`` atomically (temporary file in the same directory, then rename)."""
    text = render_report(records, facts, title, plan)
    return write_text_atomic(path, text)


# ---------------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """``galva-report METRICS.jsonl -o report.html``: exit 0, or 2 with one line ``galva-report: error: ...``."""
    from galva_schema.argparsing import OneLineParser

    p = OneLineParser(prog="galva-report", description="Plot a galva-train --metrics-jsonl file as HTML.")
    p.add_argument("metrics", help="metrics JSONL file written by galva-train --metrics-jsonl")
    p.add_argument("-o", "--output", help="HTML file to write (default: METRICS with the suffix .html)")
    p.add_argument("--title", default=None, help="page title (default: 'Galva training report: METRICS')")
    p.add_argument("--strategy", help="the strategy file the run trained (with --summary: plan, predicted costs)")
    p.add_argument("--summary", help="the galva-search --summary-json written with --strategy")
    p.add_argument("--check", help="the galva check file of this run (with --strategy): noise bands, measured base")
    args = p.parse_args(argv)
    if (args.strategy is None) != (args.summary is None):
        print("galva-report: error: --strategy and --summary go together", file=sys.stderr)
        return 2
    if args.check is not None and args.strategy is None:
        print("galva-report: error: --check needs --strategy and --summary", file=sys.stderr)
        return 2
    src = Path(args.metrics)
    out = Path(args.output) if args.output else src.with_suffix(".html")
    if out.resolve() == src.resolve():
        print(f"galva-report: error: output {out} would overwrite the metrics file", file=sys.stderr)
        return 2
    from galva_schema import output_problem

    problem = output_problem(out)
    if problem is not None:
        print(f"galva-report: error: {'--output' if args.output else 'output'} {out}: {problem}", file=sys.stderr)
        return 2
    try:
        records = load_metrics(src)
        plan = load_plan(args.strategy, args.summary, args.check) if args.strategy else None
        default_title = f"Galva {'run' if plan else 'training'} report: {src.name}"
        write_report(out, records, {"metrics file": str(src)}, args.title or default_title, plan)
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
