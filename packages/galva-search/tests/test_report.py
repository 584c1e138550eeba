"""The --report-html page: written atomically by the CLI, well-formed HTML, the right numbers in the right places,
and self-contained (nothing fetched from outside)."""

from __future__ import annotations

import dataclasses
import json
import re
import stat
from html.parser import HTMLParser

import pytest

from galva_schema import SchemaError, SearchSummary, Strategy
from galva_search.cli import main
from galva_search.cost_model import CostModel
from galva_search.report import PlanFacts, ReportError, html_report, render_page, tp_colour, write_html_report
from galva_search.search import SearchOptions, search

_VOID = {"meta", "br", "hr", "img", "input", "link", "col", "area", "base", "source", "track", "wbr"}
# SVG shapes may be written self-closed (<rect/>), which html.parser reports through handle_startendtag.


class _Page(HTMLParser):
    """Element tree enough for the checks: each element's tag, attributes, text of its <title>, and tag balance."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str | None], list[str]]] = []  # (tag, attrs, text inside)
        self.stack: list[int] = []
        self.errors: list[str] = []
        self.doctype = ""

    def handle_decl(self, decl: str) -> None:
        self.doctype = decl

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs), []))
        if tag not in _VOID:
            self.stack.append(len(self.elements) - 1)

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs), []))

    def handle_endtag(self, tag):
        if not self.stack or self.elements[self.stack[-1]][0] != tag:
            self.errors.append(f"unbalanced </{tag}>")
            return
        self.stack.pop()

    def handle_data(self, data):
        for i in self.stack:
            self.elements[i][2].append(data)

    def by_class(self, cls: str) -> list[tuple[dict[str, str | None], str]]:
        """Elements of class ``cls``: attributes and their whole text (title and labels)."""
        return [(attrs, "".join(text)) for tag, attrs, text in self.elements
                if cls in (attrs.get("class") or "").split()]


def parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    assert page.doctype.lower() == "doctype html"
    assert not page.errors and not page.stack, (page.errors, [page.elements[i][0] for i in page.stack])
    return page


def assert_self_contained(text: str) -> None:
    assert not re.search(r"https?:", text, re.I)
    assert not re.search(r"<script|<link|<img|<iframe|@import|src\s*=", text, re.I)
    assert re.findall(r"url\(([^)]*)\)", text) and all(ref.startswith("#") for ref in re.findall(r"url\(([^)]*)\)",
                                                                                                  text))


def test_cli_writes_a_self_contained_report_with_the_search_numbers(data_dir, tmp_path, capsys):
    report, summary = tmp_path / "out" / "report.html", tmp_path / "summary.json"
    code = main(["--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile",
                 # 18 GB: room for the 5% reserve and the recomputation / ZeRO-3 transients
                 str(data_dir / "llama7b_model.json"), "--quiet", "--memory", "20GB", "--global-batch-size", "64",
                 "--max-tp", "2", "--sp-space", "tp+sp", "--summary-json", str(summary),
                 "--report-html", str(report)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "samples/s" in out  # the text summary is still printed
    data = json.loads(summary.read_text())
    text = report.read_text(encoding="utf-8")
    assert not list(report.parent.glob(".*.tmp"))  # written through a temporary file, renamed
    assert stat.S_IMODE(report.stat().st_mode) & 0o044  # readable by others like any open()-made file (umask 022)
    page = parse(text)
    assert_self_contained(text)
    pp = data["pp"]
    assert pp > 1  # a tight budget and max tp 2 force a pipeline: several bars and rows to check

    # headline
    headline = "".join(t for a, t in page.by_class("card"))
    for piece in ("8", f"{data['throughput_samples_per_s']:.2f} samples/s", "/".join(map(str, data["pp_division"])),
                  "1f1b", str(data["global_batch_size"]), str(data["num_micro_batches"])):
        assert piece in headline

    # one memory bar per stage, value in its title and its label
    bars = page.by_class("mem-bar")
    assert [a["data-stage"] for a, _ in bars] == [str(i) for i in range(pp)]
    for (attrs, inner), mib in zip(bars, data["stage_memory_mib"]):
        assert attrs["data-mib"] == f"{mib:.0f}"
        assert f"MiB of {data['usable_memory_mib']:.0f} MiB usable" in inner
        assert inner.count(f"{mib:.0f} MiB") == 2  # hover title and the visible label
    lines = {a["data-kind"]: a["data-mib"] for a, _ in page.by_class("budget-line")}
    assert lines["usable"] == f"{data['usable_memory_mib']:.0f}"
    if data["memory_budget_mib"] - data["usable_memory_mib"] > 0.5:
        assert lines["budget"] == f"{data['memory_budget_mib']:.0f}"

    # one cell per layer, stage by stage, hover title = the compact label
    strategy_labels = {(r["first"], r["last"]): r["strategy"] for r in data["layer_runs"]}
    cells = page.by_class("layer-cell")
    assert [int(a["data-layer"]) for a, _ in cells] == list(range(sum(data["pp_division"])))
    for attrs, inner in cells:
        index = int(attrs["data-layer"])
        label = next(v for (first, last), v in strategy_labels.items() if first <= index <= last)
        assert attrs["data-label"] == label and inner.startswith(f"layer {index}: {label}")

    # legend: every degree used, and the marker keys
    legend = {a["data-kind"] for a, _ in page.by_class("legend-item")}
    assert {"ulysses", "zero2", "zero3", "checkpoint"} <= legend
    assert {f"tp-{a['data-tp']}" for a, _ in cells} <= legend

    # per-stage micro-batch time, and the counts of the search log
    times = page.by_class("time-bar")
    assert [a["data-ms"] for a, _ in times] == [f"{t * 1e3:.2f}" for t in data["stage_micro_batch_time_s"]]
    for (_, inner), t in zip(times, data["stage_micro_batch_time_s"]):
        assert inner.count(f"{t * 1e3:.2f} ms") == 2  # hover title and the visible label
    table = next("".join(text) for _, attrs, text in page.elements if attrs.get("id") == "search-counts")
    assert f"tasks tried{data['counts']['tasks']}" in table
    assert f"pruned by memory bound{data['counts']['pruned_memory']}" in table


def test_layer_cells_mark_tp_ulysses_zero_and_checkpointing(make_hw, make_model, tmp_path):
    cost = CostModel(make_hw(4), make_model(4))
    result = search(cost, SearchOptions(memory_budget_mib=16384.0, batch_sizes=(8,)))
    s = result.strategy.to_dict()
    s.update(pp=2, pp_division=[2, 2], layers=[
        {"tp": 1, "dp_type": "ddp"},
        {"tp": 2, "ulysses": True, "dp_type": "zero2"},
        {"tp": 1, "dp_type": "zero3", "checkpoint": True},
        {"tp": 2, "tp_consecutive": False, "dp_type": "zero3"},
    ])
    strategy = Strategy.from_dict(s)
    summary = SearchSummary.from_dict({
        **result.summary.to_dict(), "pp": 2, "pp_division": [2, 2], "stage_memory_mib": [17000.0, 900.0],
        "stage_micro_batch_time_s": [0.004, 0.006], "usable_memory_mib": 12000.0,
    })
    hand = dataclasses.replace(result, strategy=strategy, summary=summary)
    path = write_html_report(tmp_path / "r.html", hand)
    text = path.read_text(encoding="utf-8")
    page = parse(text)
    assert_self_contained(text)
    cells = {int(a["data-layer"]): (a, inner) for a, inner in page.by_class("layer-cell")}
    assert [cells[i][0]["data-dp-type"] for i in range(4)] == ["ddp", "zero2", "zero3", "zero3"]
    assert [cells[i][0]["data-ulysses"] for i in range(4)] == ["0", "1", "0", "0"]
    assert [cells[i][0]["data-checkpoint"] for i in range(4)] == ["0", "0", "1", "0"]
    assert cells[1][1].startswith(f"layer 1: {strategy.layer_summary(1)}") and strategy.layer_summary(1).endswith("-sp")
    # the fills behind each cell: tp colour, the Ulysses stripes, the ZeRO dot, the checkpoint bar
    groups = re.findall(r'<g class="layer-cell".*?</g>', text)
    assert len(groups) == 4
    assert f'fill="{tp_colour(1)}"' in groups[0] and f'fill="{tp_colour(2)}"' in groups[1]
    assert tp_colour(1) != tp_colour(2)
    assert "url(#ulysses)" in groups[1] and all("url(#ulysses)" not in groups[i] for i in (0, 2, 3))
    assert "<circle" not in groups[0] and 'fill="#fff" stroke="#222"' in groups[1]
    assert '<circle' in groups[2] and 'fill="#222"/>' in groups[2]
    assert 'height="4" fill="#222"' in groups[2] and 'height="4"' not in groups[3]
    # stage 0 is over the budget, stage 1 fits; the legend lists both degrees
    bar0, bar1 = (re.search(r'fill="(#[0-9A-F]{6})" rx', g).group(1)
                  for g in re.findall(r'<g class="mem-bar".*?</g>', text))
    assert hand.summary.memory_budget_mib < 17000.0
    assert (bar0, bar1) == ("#D1495B", "#2E9E5B")  # red over budget, green fits
    legend = {a["data-kind"] for a, _ in page.by_class("legend-item")}
    assert {"tp-1", "tp-2"} <= legend
    slow = [inner for a, inner in page.by_class("time-bar") if "slowest" in inner]
    assert len(slow) == 1 and slow[0].startswith("stage 1")


def test_write_html_report_writes_html_report(make_hw, make_model, tmp_path):
    cost = CostModel(make_hw(4), make_model(4))
    result = search(cost, SearchOptions(memory_budget_mib=16384.0, batch_sizes=(8,)))
    path = write_html_report(tmp_path / "sub" / "r.html", result)
    assert path.read_text(encoding="utf-8") == html_report(result)
    page = parse(html_report(result))
    assert len(page.by_class("mem-bar")) == result.strategy.pp
    assert len(page.by_class("layer-cell")) == result.strategy.num_layers


@pytest.mark.parametrize("degree", [1, 2, 4, 8, 16, 3, 1024])
def test_tp_colour_is_a_hex_colour(degree):
    assert re.fullmatch(r"#[0-9A-F]{6}", tp_colour(degree))


def test_time_breakdown_sums_to_the_iteration_and_is_drawn(data_dir, tmp_path):
    """The pipeline (pp > 1) plan of the CLI test: every kind of time appears, the parts add up to the prediction."""
    summary = tmp_path / "summary.json"
    assert main(["--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile",
                 str(data_dir / "llama7b_model.json"), "--quiet", "--memory", "20GB", "--global-batch-size", "64",
                 "--max-tp", "2", "--sp-space", "tp+sp", "--summary-json", str(summary),
                 "--output", str(tmp_path / "plan.json")]) == 0
    data = json.loads(summary.read_text())
    parts = data["time_breakdown_s"]
    assert {"compute", "tp", "dp", "p2p", "bubble"} <= set(parts) and data["pp"] > 1
    assert parts["p2p"] > 0 and parts["bubble"] > 0 and parts["compute"] > max(parts["tp"], parts["dp"])
    assert sum(parts.values()) == pytest.approx(data["iteration_time_s"], rel=1e-12)
    plan = PlanFacts.matched(Strategy.load(tmp_path / "plan.json"), SearchSummary.load(summary))
    page = parse(render_page(plan))
    drawn = {a["data-kind"]: float(a["data-s"]) for a, _ in page.by_class("time-part")}
    assert drawn == pytest.approx({k: v for k, v in parts.items() if v > 0}, rel=1e-5)


def test_a_run_page_has_plan_training_and_measured_sections(make_hw, make_model):
    cost = CostModel(make_hw(4), make_model(4))
    result = search(cost, SearchOptions(memory_budget_mib=16384.0, batch_sizes=(8,)))
    records = [{"step": t, "loss": 5.0 - 0.1 * t, "step_time_s": 0.5 + 0.01 * t, "tokens_per_s": 1000.0,
                "peak_memory_mib": 700.0 + t} for t in range(1, 11)]
    text = render_page(PlanFacts(result.strategy, result.summary), records, {"model": "m"})
    page = parse(text)
    ids = {attrs.get("id") for _, attrs, _ in page.elements}
    assert {"plan", "memory", "time", "training", "measured", "chart-loss", "chart-tokens_per_s"} <= ids
    bars = {(a["data-kind"], a["data-which"]): float(a["data-value"]) for a, _ in page.by_class("mvp-bar")}
    assert bars[("step_time", "measured")] == pytest.approx(0.56)  # median of steps 2..10
    assert bars[("step_time", "predicted")] == pytest.approx(result.summary.iteration_time_s, rel=1e-5)
    assert bars[("memory", "measured")] == 710.0
    assert bars[("memory", "predicted")] == pytest.approx(result.summary.stage_memory_mib[0], rel=1e-5)
    with pytest.raises(ReportError, match="nothing to report"):
        render_page()
    with pytest.raises(SchemaError, match=r"kind: expected 'galva\.search_summary', got 'galva\.strategy'"):
        SearchSummary.from_dict({"kind": "galva.strategy"})
    n = result.strategy.num_micro_batches
    other = SearchSummary.from_dict({**result.summary.to_dict(), "num_micro_batches": n + 1})
    with pytest.raises(ReportError, match=rf"num_micro_batches is {n + 1}, but {n} in strategy: the summary of anoth"):
        PlanFacts.matched(result.strategy, other)


def test_usable_and_budget_labels_never_overlap(make_hw, make_model):
    """However close the two lines (the reserve from 1 MiB to a third of the budget, stage memory below, at and above
    them), the labels' baselines are at least a font height apart and each stays inside the chart."""
    cost = CostModel(make_hw(4), make_model(4))
    result = search(cost, SearchOptions(memory_budget_mib=16384.0, batch_sizes=(8,)))
    plan = PlanFacts(result.strategy, result.summary)
    budget = 16384.0
    for reserve in (1.0, 20.0, 100.0, 300.0, 500.0, 819.2, 1000.0, 2000.0, 5000.0):
        for stage_mib in (budget - 2 * reserve, budget - reserve / 2, budget + 500.0):
            facts = _with(plan, memory_budget_mib=budget, usable_memory_mib=budget - reserve,
                          stage_memory_mib=[stage_mib] * len(plan.summary.stage_memory_mib))
            labels = {a["data-kind"]: a for a, _ in parse(render_page(facts)).by_class("line-label")}
            assert set(labels) == {"usable", "budget"}
            font = float(labels["usable"]["font-size"])
            assert font == float(labels["budget"]["font-size"])
            gap = float(labels["usable"]["y"]) - float(labels["budget"]["y"])
            assert gap >= font, (reserve, stage_mib, gap)  # the budget label above the usable one, a line apart
            assert all(font <= float(a["y"]) <= 300 - 40 for a in labels.values()), (reserve, labels)
    equal = _with(plan, memory_budget_mib=budget, usable_memory_mib=budget)
    [(attrs, text)] = parse(render_page(equal)).by_class("line-label")
    assert attrs["data-kind"] == "usable" and text == "usable = budget 16384 MiB"


def _with(plan: PlanFacts, **changes: object) -> PlanFacts:
    """``plan`` with some summary fields changed (validated as a file would be)."""
    return dataclasses.replace(plan, summary=SearchSummary.from_dict({**plan.summary.to_dict(), **changes}))
