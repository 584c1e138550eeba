"""Least-squares fits of measured times, with their residuals.

Two shapes are fitted: a line (the alpha-beta model ``t = alpha + beta * x`` of a collective against message size,
and of a layer's forward time against batch size) and a quadratic (a layer's time per sample against sequence
length). Every fit reports how well it explains the points, so a profile whose numbers do not follow the model says
so instead of hiding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fit:
    """Polynomial coefficients (highest power first) and the residuals of the points they were fitted to."""

    coefficients: tuple[float, ...]
    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __call__(self, x: float) -> float:
        return float(np.polyval(self.coefficients, x))

    @property
    def residuals(self) -> tuple[float, ...]:
        """Measured minus fitted, per point."""
        return tuple(y - self(x) for x, y in zip(self.xs, self.ys))

    @property
    def max_relative_residual(self) -> float:
        """Largest ``|residual| / measured`` over the points (0 for a perfect fit)."""
        return max((abs(r) / abs(y) if y else abs(r)) for r, y in zip(self.residuals, self.ys))

    @property
    def rms_relative_residual(self) -> float:
        """Root mean square of ``residual / measured``."""
        rel = [(r / y if y else r) for r, y in zip(self.residuals, self.ys)]
        return float(np.sqrt(np.mean(np.square(rel))))

    def to_dict(self) -> dict[str, object]:
        return {
            "coefficients": list(self.coefficients),
            "points": [[x, y] for x, y in zip(self.xs, self.ys)],
            "residuals": list(self.residuals),
            "max_relative_residual": self.max_relative_residual,
            "rms_relative_residual": self.rms_relative_residual,
        }


def polyfit(xs: Sequence[float], ys: Sequence[float], degree: int) -> Fit:
    """Least-squares polynomial of ``degree``; needs ``degree + 1`` distinct x values (``ValueError`` otherwise)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    if len(set(xs)) < degree + 1:
        raise ValueError(f"a degree-{degree} fit needs {degree + 1} distinct points, got {len(set(xs))}")
    coefficients = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), degree)
    return Fit(tuple(float(c) for c in coefficients), tuple(float(x) for x in xs), tuple(float(y) for y in ys))


def alpha_beta(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    """``t = beta * x + alpha``: coefficients ``(beta, alpha)``."""
    return polyfit(xs, ys, 1)


def quadratic(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    """``t = a x^2 + b x + c``: coefficients ``(a, b, c)``."""
    return polyfit(xs, ys, 2)
