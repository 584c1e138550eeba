"""Per-term correction factors fitted from a check (a :class:`galva_schema.Calibration`).

Time: the predicted iteration time ``T(f)`` is positively homogeneous in the term factors ``f`` (every term, max and
overlap scales with them), so at any ``f`` it splits exactly into per-family contributions ``c_k = f_k dT/df_k``
(Euler), measured by finite differences through galva-search's own evaluation. The factors solve the ridge
least-squares problem ``min sum_s ((sum_k x_k c_sk - T_s) / T_s)^2 + lam sum_k (x_k - 1)^2`` (relative errors;
the ridge keeps a family that no run exercises at its current value), then ``f_k *= x_k``; three rounds, clipped
to [0.05, 20]. Memory: the median measured / predicted ratio of model states and of activations.
"""

from __future__ import annotations

import statistics
from dataclasses import fields, replace

import numpy as np

from galva_profiler.check import CheckOptions, StrategyCheck, predict
from galva_schema import Calibration, CalibrationPoint, HardwareProfile, MemoryFactors, ModelProfile, TimeFactors

TIME_TERMS = ("compute", "tp_comm", "dp_comm", "p2p", "redistribution")


def fit_calibration(
    checks: list[StrategyCheck],
    hardware: HardwareProfile,
    model: ModelProfile,
    options: CheckOptions,
    ridge: float = 0.05,
    rounds: int = 3,
) -> Calibration:
    from galva_search.cost_model import TermFactors

    factors = TermFactors()
    measured = np.array([check.measured_time_s for check in checks])

    def times(f: TermFactors) -> np.ndarray:
        return np.array([predict(hardware, model, check.strategy, options, f).iteration_time_s for check in checks])

    for _ in range(rounds):
        base = times(factors)
        contrib = np.empty((len(checks), len(TIME_TERMS)))
        for k, name in enumerate(TIME_TERMS):
            eps = 1e-3
            bumped = replace(factors, **{name: getattr(factors, name) * (1 + eps)})
            contrib[:, k] = (times(bumped) - base) / eps
        a = contrib / measured[:, None]
        b = np.ones(len(checks))
        a = np.vstack([a, np.sqrt(ridge) * np.eye(len(TIME_TERMS))])
        b = np.concatenate([b, np.sqrt(ridge) * np.ones(len(TIME_TERMS))])
        x, *_ = np.linalg.lstsq(a, b, rcond=None)
        updates = {name: float(np.clip(getattr(factors, name) * x[k], 0.05, 20.0)) for k, name in enumerate(TIME_TERMS)}
        factors = replace(factors, **updates)
    rows = [row for check in checks for row in check.rows]
    states = statistics.median(r.measured_states_mib / r.predicted_states_mib for r in rows if r.predicted_states_mib)
    acts = statistics.median(
        r.measured_activation_mib / r.predicted_activation_mib for r in rows if r.predicted_activation_mib
    )
    factors = replace(factors, states=states, activations=acts)
    uncalibrated = times(replace(factors, **{f.name: 1.0 for f in fields(factors)}))
    calibrated = times(factors)
    return Calibration(
        model_name=model.model_name,
        world_size=checks[0].strategy.world_size if checks else None,
        time_factors=TimeFactors(**{name: getattr(factors, name) for name in TIME_TERMS}),
        memory_factors=MemoryFactors(states=states, activations=acts),
        points=tuple(
            CalibrationPoint(strategy=check.name, measured_s=float(m), predicted_s=float(p), calibrated_s=float(c))
            for check, m, p, c in zip(checks, measured, uncalibrated, calibrated)
        ),
    )
