"""Pure-Python least squares used by the model-profile converter."""

from __future__ import annotations

import pytest

from galva_schema.reference import polyfit


def test_exact_line_and_quadratic():
    xs = [1, 2, 3, 4, 5, 6, 7, 8]
    assert polyfit(xs, [3.0 * x - 2.0 for x in xs], 1) == pytest.approx((3.0, -2.0))
    seqs = [4096, 8192, 16384, 32768, 65536]
    ys = [2e-8 * s * s + 1e-3 * s + 0.5 for s in seqs]
    assert polyfit(seqs, ys, 2) == pytest.approx((2e-8, 1e-3, 0.5), rel=1e-7)


def test_least_squares_of_noisy_points():
    # slope = cov / var = 3 / 5, intercept = mean_y - slope * mean_x = 1.5 - 0.9
    xs = [0, 1, 2, 3]
    assert polyfit(xs, [1.0, 0.0, 3.0, 2.0], 1) == pytest.approx((0.6, 0.6))  # hand-computed normal equations


def test_too_few_points():
    with pytest.raises(ValueError, match="needs at least 3 distinct points"):
        polyfit([1, 2, 2], [1.0, 2.0, 2.0], 2)
    with pytest.raises(ValueError, match="x values"):
        polyfit([1, 2], [1.0], 1)
