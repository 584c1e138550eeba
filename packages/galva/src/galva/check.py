"""``galva check``: hold a training run against its plan's prediction, and calibrate the next search when they differ.

    galva check --metrics metrics.jsonl --strategy strategy.json --summary summary.json -o check.json \\
        [--calibration-output calibration.json] [--calibration used.json]

Nothing is trained again: the run's own metrics hold what is compared (galva-train logs them on rank 0, stage 0).

* **Step time**: the median of the steps after the first (the first builds caches and optimizer states) against
  the summary's iteration time. Noise band: half the spread between the 10th and 90th percentile of those steps,
  relative to their median, and at least 2%.
* **Peak memory per device**: the base the run measured before building its model plus the peak above it (GPU: the
  allocator's peak; CPU, which has no allocator counter: the resident high-water mark less that base), against the
  summary's stage-0 memory. Noise band 2%: one high-water mark, read once, moves by allocator rounding and pages the
  run's bookkeeping touches.

When a quantity falls outside its band a :class:`galva_schema.Calibration` is written for ``galva-search
--calibration``: every time factor scaled by measured / predicted (the iteration time is homogeneous in them, so the
next prediction of this plan is the measured time), and as base memory the measured peak less the memory terms the
cost model priced (which puts what those terms do not see, such as library buffers on CPU, in the base). Factors of
a calibration the search already used (``--calibration``) are carried forward, not restarted.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from galva_schema import (
    Agreement,
    Calibration,
    CalibrationPoint,
    RunCheck,
    SearchSummary,
    Strategy,
    TimeFactors,
)

__all__ = ["MEMORY_NOISE", "MIN_TIME_NOISE", "check_run", "describe", "step_time"]

MIN_TIME_NOISE = 0.02
MEMORY_NOISE = 0.02


def _records(path: Path) -> list[dict[str, object]]:
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not JSON ({err.msg})") from None
    return records


def _numbers(records: list[dict[str, object]], key: str, path: Path) -> list[float]:
    values = [r.get(key) for r in records]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise ValueError(f"{path}: every step record needs a number '{key}' (written by galva-train --metrics-jsonl)")
    return [float(v) for v in values]  # type: ignore[arg-type]


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks of an ascending list."""
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def step_time(times: list[float]) -> tuple[float, float, int]:
    """(median seconds, relative noise band, steps timed) of a run's step times, the first step left out."""
    timed = sorted(times[1:] if len(times) > 1 else times)
    median = statistics.median(timed)
    spread = (_quantile(timed, 0.9) - _quantile(timed, 0.1)) / 2.0
    return median, max(MIN_TIME_NOISE, spread / median if median else 0.0), len(timed)


def check_run(
    metrics: Path,
    strategy: Path,
    summary: Path,
    output: Path,
    calibration_output: Path | None = None,
    calibration: Path | None = None,
) -> RunCheck:
    """Compare, write ``output`` (and ``calibration_output`` when something is outside its band); return the check.

    Raises ``ValueError`` (one line naming the file) for metrics without the fields, or a summary of another plan."""
    plan = Strategy.load(strategy)
    predicted = SearchSummary.load(summary)
    mismatch = predicted.mismatch(plan)
    if mismatch is not None:
        raise ValueError(f"{summary}: {mismatch} in {strategy}: the summary of another plan")
    records = _records(metrics)
    if not records:
        raise ValueError(f"{metrics}: no step records")
    measured_s, time_noise, timed = step_time(_numbers(records, "step_time_s", metrics))
    base = max(_numbers(records, "base_memory_mib", metrics))  # on a GPU it grows over the first steps
    above = max(_numbers(records, "peak_above_base_mib", metrics))
    # a summary from before the base was recorded: take the run's base as the one reserved
    predicted_base = base if predicted.base_memory_mib is None else predicted.base_memory_mib
    predicted_peak = predicted.stage_memory_mib[0]
    time_check = Agreement(predicted=predicted.iteration_time_s, measured=measured_s, noise=time_noise)
    peak_check = Agreement(predicted=predicted_peak, measured=base + above, noise=MEMORY_NOISE)
    base_check = Agreement(predicted=predicted_base, measured=base, noise=MEMORY_NOISE)
    written = None
    if calibration_output is not None and not (time_check.agrees and peak_check.agrees):
        used = Calibration.load(calibration) if calibration is not None else Calibration()
        _calibration(used, strategy, plan.world_size, time_check, peak_check, predicted_base).save(calibration_output)
        written = str(calibration_output)
    result = RunCheck(strategy=str(strategy), summary=str(summary), metrics=str(metrics), timed_steps=timed,
                      step_time_s=time_check, peak_memory_mib=peak_check, base_memory_mib=base_check,
                      calibration=written)
    result.save(output)
    return result


def describe(check: RunCheck) -> str:
    """One line: each quantity's measured / predicted ratio and whether it is inside its noise band."""

    def part(name: str, a: Agreement, unit: str) -> str:
        verdict = "within" if a.agrees else "outside"
        return (f"{name} {a.measured:.4g} {unit} measured / {a.predicted:.4g} predicted = {a.ratio:.2f}x "
                f"({verdict} ±{a.noise:.0%})")

    return f"{part('step time', check.step_time_s, 's')}, {part('peak', check.peak_memory_mib, 'MiB')}"


def _calibration(used: Calibration, plan: Path, world_size: int, time_check: Agreement, peak_check: Agreement,
                 predicted_base: float) -> Calibration:
    """The calibration after this run: time factors scaled by measured / predicted, the base re-measured."""
    scale = 1.0 if time_check.agrees else time_check.ratio
    t = used.time_factors
    scaled = TimeFactors(**{name: min(1000.0, getattr(t, name) * scale) for name in TimeFactors.model_fields})
    model_terms = peak_check.predicted - predicted_base  # the memory the cost model priced for stage 0
    base = predicted_base if peak_check.agrees else max(0.0, peak_check.measured - model_terms)
    point = CalibrationPoint(strategy=str(plan), measured_s=time_check.measured, predicted_s=time_check.predicted,
                             calibrated_s=time_check.predicted * scale)
    return Calibration(model_name=used.model_name, world_size=world_size, time_factors=scaled,
                       memory_factors=used.memory_factors, points=(*used.points, point), base_memory_mib=base)
