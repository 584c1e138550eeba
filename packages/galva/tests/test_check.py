"""galva check: a run's measured step time and peak against its plan's prediction, and the calibration that makes the
next search predict what was measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from galva.check import MIN_TIME_NOISE, check_run, step_time
from galva.cli import main
from galva_schema import Calibration, RunCheck, SearchSummary

DATA = Path(__file__).resolve().parents[2] / "galva-search" / "tests" / "data"


def _search(tmp_path: Path, name: str, *extra: str) -> tuple[Path, Path]:
    from galva_search.cli import main as search_main

    plan, summary = tmp_path / f"{name}-plan.json", tmp_path / f"{name}-summary.json"
    assert search_main(["--hardware-profile", str(DATA / "hw_1x8.json"), "--model-profile",
                        str(DATA / "llama7b_model.json"), "--memory", "200GB", "--global-batch-size", "32", "--quiet",
                        "--output", str(plan), "--summary-json", str(summary), *extra]) == 0  # fmt: skip
    return plan, summary


def _metrics(path: Path, times: list[float], base_mib: float, above_mib: float) -> Path:
    """A galva-train --metrics-jsonl file: the peak above the base grows to ``above_mib`` over the steps."""
    with path.open("w") as f:
        for step, seconds in enumerate(times, start=1):
            record = {"step": step, "loss": 5.0 / step, "step_time_s": seconds, "peak_memory_mib": base_mib + above_mib,
                      "base_memory_mib": base_mib, "peak_above_base_mib": above_mib * step / len(times)}
            f.write(json.dumps(record) + "\n")
    return path


def test_step_time_is_the_median_without_the_first_step_and_its_band_the_spread() -> None:
    median, noise, timed = step_time([9.0, 1.0, 1.1, 0.9, 1.0, 1.2, 0.8])  # the first (9 s) builds caches
    assert timed == 6 and median == pytest.approx(1.0)
    assert noise == pytest.approx((1.15 - 0.85) / 2)  # half the 10-90 percentile spread, relative to the median
    assert step_time([2.0, 1.0, 1.0, 1.0])[1] == MIN_TIME_NOISE  # a steady run still has a floor


def test_a_run_outside_the_band_calibrates_the_next_search_to_what_it_measured(tmp_path: Path) -> None:
    """The loop closed: measured 1.3x the predicted step time and a peak 10% over; the calibration written makes
    galva-search predict the measured time and peak for the same plan, and a check of that prediction agrees."""
    plan, summary = _search(tmp_path, "first")
    predicted = SearchSummary.load(summary)
    assert predicted.base_memory_mib == 1024.0  # the profile measured no base: the default is what was reserved
    measured_s = 1.3 * predicted.iteration_time_s
    model_mib = predicted.stage_memory_mib[0] - predicted.base_memory_mib
    extra = 0.1 * predicted.stage_memory_mib[0]  # measured peak 10% over the prediction, base 900 MiB
    times = [5 * measured_s] + [measured_s * f for f in (1.0, 1.01, 0.99, 1.0, 1.02, 0.98)]
    metrics = _metrics(tmp_path / "metrics.jsonl", times, 900.0, model_mib + extra + 124.0)
    got = check_run(metrics, plan, summary, tmp_path / "check.json", tmp_path / "cal.json")
    assert RunCheck.load(tmp_path / "check.json") == got
    assert got.step_time_s.ratio == pytest.approx(1.3, rel=1e-3) and not got.step_time_s.agrees
    assert got.peak_memory_mib.measured == pytest.approx(1.1 * predicted.stage_memory_mib[0])
    assert got.base_memory_mib.measured == 900.0 and got.calibration == str(tmp_path / "cal.json")
    cal = Calibration.load(tmp_path / "cal.json")
    assert cal.time_factors.compute == pytest.approx(1.3, rel=1e-3) == cal.time_factors.dp_comm
    assert cal.base_memory_mib == pytest.approx(1024.0 + extra)  # what the memory terms did not price goes to base

    plan2, summary2 = _search(tmp_path, "again", "--calibration", str(tmp_path / "cal.json"))
    again = SearchSummary.load(summary2)
    assert json.loads(plan2.read_text())["layers"] == json.loads(plan.read_text())["layers"]  # the same plan
    assert again.iteration_time_s == pytest.approx(measured_s, rel=2e-3)
    assert again.stage_memory_mib[0] == pytest.approx(got.peak_memory_mib.measured, rel=1e-6)
    closed = check_run(metrics, plan2, summary2, tmp_path / "check2.json", tmp_path / "cal2.json",
                       tmp_path / "cal.json")
    assert closed.step_time_s.agrees and closed.peak_memory_mib.agrees and closed.calibration is None
    assert not (tmp_path / "cal2.json").exists()


def test_check_refuses_metrics_without_the_fields_and_another_plans_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan, summary = _search(tmp_path, "first")
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"step": 1, "loss": 1.0, "step_time_s": 1.0, "peak_memory_mib": 10.0}) + "\n")
    other = tmp_path / "other.json"
    data = json.loads(plan.read_text())
    data["global_batch_size"] *= 2
    other.write_text(json.dumps(data))
    for argv, names in (
        (["--metrics", str(old), "--strategy", str(plan)], "every step record needs a number 'base_memory_mib'"),
        (["--metrics", str(old), "--strategy", str(other)], "the summary of another plan"),
        (["--metrics", str(tmp_path / "none.jsonl"), "--strategy", str(plan)], "--metrics"),
    ):
        assert main(["check", *argv, "--summary", str(summary), "-o", str(tmp_path / "c.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("galva: error: ") and names in err, err
    assert not (tmp_path / "c.json").exists()
