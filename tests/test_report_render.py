"""The one report page renders in headless Chromium: a screenshot is taken and the rendered DOM holds the plan,
memory, time and loss sections with their drawings. Skipped, saying why, where no Chromium is installed
(Debian: `apt-get install chromium`; .ci/run installs it when it runs as root)."""

from __future__ import annotations

import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from galva_schema import Strategy
from galva_search.cost_model import CostModel
from galva_search.report import PlanFacts, render_page
from galva_search.search import SearchOptions, search

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llama-7b-8gpu"
BROWSER = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no headless Chromium here (apt-get install chromium)")


class _Sections(HTMLParser):
    """Ids of the rendered elements and the shapes drawn inside each section."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.section: str | None = None
        self.shapes: dict[str, int] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(str(a["id"]))
        if tag == "section":
            self.section = str(a.get("id"))
            self.shapes[self.section] = 0
        elif self.section and tag in ("rect", "polyline", "circle"):
            self.shapes[self.section] += 1


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert BROWSER is not None
    return subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", "--disable-dev-shm-usage", *args],
                          capture_output=True, text=True, timeout=120)


def test_run_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    from galva_schema import HardwareProfile, ModelProfile

    cost = CostModel(HardwareProfile.load(EXAMPLE / "hardware.json"), ModelProfile.load(EXAMPLE / "model.json"))
    result = search(cost, SearchOptions(memory_budget_mib=20000.0, batch_sizes=(64,)))
    assert isinstance(result.strategy, Strategy)
    records = [{"step": t, "loss": 10.0 / (1 + 0.2 * t), "tokens_per_s": 9000.0 + 50 * t,
                "step_time_s": 14.0 - 0.01 * t, "peak_memory_mib": 30000.0 + t} for t in range(1, 31)]
    page = tmp_path / "report.html"
    plan = PlanFacts(result.strategy, result.summary)
    page.write_text(render_page(plan, records, {"model": "llama-7b"}), encoding="utf-8")

    shot = tmp_path / "report.png"
    run = _chromium("--window-size=1100,3200", f"--screenshot={shot}", page.as_uri())
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    header = shot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert (width, height) == (1100, 3200) and shot.stat().st_size > 20_000  # a drawn page, not a blank one

    dom = _chromium("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = _Sections()
    parsed.feed(dom.stdout)
    assert {"plan", "memory", "time", "training", "measured", "layer-map", "memory-chart", "time-breakdown",
            "chart-loss", "chart-tokens_per_s", "measured-chart"} <= parsed.ids
    for section in ("plan", "memory", "time", "training", "measured"):
        assert parsed.shapes[section] > 0, section  # each section drew something
    assert parsed.shapes["plan"] >= result.strategy.num_layers  # one cell per layer at least
