"""galva_models.report / galva-report: a metrics JSONL file as one self-contained HTML page of SVG charts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from galva_models.cli.config import ConfigError, parse_train_config
from galva_models.report import CHARTS, ReportError, load_metrics, main, render_report, write_report

METRICS = [c.key for c in CHARTS]


def _records(n: int) -> list[dict[str, object]]:
    """Step records shaped like galva-train's, with values that differ per step."""
    return [
        {
            "step": t + 1,
            "loss": 10.0 * math.exp(-t / 15) + 0.1 * math.sin(t),
            "lr": 3e-3 * min(1.0, (t + 1) / 5),
            "grad_norm": 1.0 + 0.5 * math.cos(t),
            "step_time_s": 0.2 + 0.01 * (t % 3),
            "tokens_per_s": 1280.0 / (0.2 + 0.01 * (t % 3)),
            "tflops": 0.05 + 0.001 * t,
            "peak_memory_mib": 512.0 + t,
        }
        for t in range(n)
    ]


def _write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


class _Page(HTMLParser):
    """Collects, per chart figure, its hover markers (circles with a <title>) and every URL-bearing attribute."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.charts: dict[str, dict[str, int]] = {}
        self.current: str | None = None
        self.scripts = 0
        self.urls: list[str] = []
        self.stack: list[str] = []
        self.in_title = False
        self.titles: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.stack.append(tag)
        if tag == "script":
            self.scripts += 1
        for name in ("src", "href", "xlink:href", "data"):
            if a.get(name):
                self.urls.append(str(a[name]))
        if tag == "figure" and a.get("data-metric"):
            self.current = str(a["data-metric"])
            self.charts[self.current] = {"declared": int(str(a["data-points"])), "markers": 0, "svg": 0, "lines": 0}
        elif self.current is not None and tag in ("circle", "svg", "polyline"):
            self.charts[self.current][{"circle": "markers", "svg": "svg", "polyline": "lines"}[tag]] += 1
        if tag == "title" and "circle" in self.stack:
            self.in_title = True

    def handle_endtag(self, tag: str) -> None:
        while self.stack and self.stack.pop() != tag:
            pass  # tolerate unclosed void-like tags
        if tag == "figure":
            self.current = None
        if tag == "title":
            self.in_title = False

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.titles.append(data)


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    return page


def test_one_chart_per_metric_with_every_point(tmp_path):
    src = _write_jsonl(tmp_path / "metrics.jsonl", _records(37))
    out = write_report(tmp_path / "out" / "report.html", load_metrics(src), {"model": "tiny-llama"})
    text = out.read_text()
    page = _parse(text)
    assert list(page.charts) == METRICS
    for key, chart in page.charts.items():
        assert chart["svg"] == 1, key
        assert chart["declared"] == chart["markers"] == 37, key
        assert chart["lines"] == (2 if key == "loss" else 1), key  # loss: per-step and smoothed lines
    assert "step 36: loss" in "".join(page.titles)
    assert "<dt>model</dt><dd>tiny-llama</dd>" in text and "<dt>steps</dt><dd>37</dd>" in text
    assert not list(out.parent.glob(".*.tmp"))  # the temporary file was renamed, not left behind


def test_self_contained_no_external_assets(tmp_path):
    page_text = render_report(_records(5), {"data": "https://example.com/<x>"})
    page = _parse(page_text)
    assert page.scripts == 0 and page.urls == []
    assert "://" not in page_text.replace("https://example.com/&lt;x&gt;", "")  # the fact, escaped, is the only one
    assert "<x>" not in page_text
    assert "url(" not in page_text and "@import" not in page_text


def test_gaps_and_missing_metrics(tmp_path):
    records = _records(10)
    records[3]["loss"] = float("nan")  # galva-train logs NaN as NaN (allow_nan); that step is a gap
    for r in records:
        r["grad_norm"] = None  # e.g. no clipping: nothing to plot
        del r["peak_memory_mib"]
    src = tmp_path / "m.jsonl"
    src.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in records) + "\n")  # blank line tolerated
    page = _parse(render_report(load_metrics(src)))
    assert page.charts["loss"]["markers"] == 9
    assert "grad_norm" not in page.charts and "peak_memory_mib" not in page.charts
    assert page.charts["lr"]["markers"] == 10


def test_long_runs_thin_the_markers_not_the_count():
    page = _parse(render_report(_records(5000)))
    chart = page.charts["loss"]
    assert chart["declared"] == 5000 and 1000 <= chart["markers"] <= 2000


def test_single_step_run():
    page = _parse(render_report(_records(1)))
    assert all(c["markers"] == 1 for c in page.charts.values())


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": \n', "m.jsonl:2: not JSON"),
        ('{"step": 0}\n\n[1, 2]\n', "m.jsonl:3: expected a JSON object, got list"),
        ('{"loss": 1.0}\n', "m.jsonl:1: 'step' must be an integer, got None"),
        ('{"step": 0, "loss": {"a": 1}}\n', "m.jsonl:1: 'loss' must be a number, got dict"),
        ("\n\n", "m.jsonl: no step records"),
    ],
)
def test_malformed_file_is_a_one_line_error(tmp_path, content, message):
    src = tmp_path / "m.jsonl"
    src.write_text(content)
    with pytest.raises(ReportError) as err:
        load_metrics(src)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_command_writes_report_and_reports_errors_in_one_line(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "metrics.jsonl", _records(12))
    out = tmp_path / "r.html"
    assert main([str(src), "-o", str(out)]) == 0
    assert list(_parse(out.read_text()).charts) == METRICS
    assert main([str(src)]) == 0 and (tmp_path / "metrics.html").exists()  # default: METRICS with .html

    capsys.readouterr()
    assert main([str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"galva-report: error: {tmp_path / 'missing.jsonl'}: no such file"

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_records(1)[0]) + "\nnot json\n")
    before = out.read_text()
    assert main([str(bad), "-o", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"galva-report: error: {bad}:2: not JSON")
    assert out.read_text() == before  # a failed run leaves an existing report untouched


def test_installed_script(tmp_path):
    script = Path(sys.executable).parent / "galva-report"
    if not script.exists():
        pytest.skip("galva-report is not installed in this environment (re-run the editable install)")
    src = _write_jsonl(tmp_path / "metrics.jsonl", _records(3))
    proc = subprocess.run([str(script), str(src), "-o", str(tmp_path / "r.html")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([str(script), str(tmp_path / "nope.jsonl")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "nope.jsonl: no such file" in proc.stderr


def test_train_config_report_html(tmp_path):
    base = ["--model", "tiny-gpt2", "--seq-length", "16"]
    assert parse_train_config(base).report_html is None
    path = str(tmp_path / "r.html")
    assert parse_train_config([*base, "--report-html", path]).report_html == path
    same = os.path.join(str(tmp_path), "m.jsonl")
    with pytest.raises(ConfigError, match=r"--report-html .* is the --metrics-jsonl file"):
        parse_train_config([*base, "--metrics-jsonl", same, "--report-html", same])
