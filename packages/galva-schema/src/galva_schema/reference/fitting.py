"""Least-squares polynomial fits in pure Python (galva-schema depends on pydantic only, so no numpy)."""

from __future__ import annotations

from collections.abc import Sequence


def polyfit(xs: Sequence[float], ys: Sequence[float], degree: int) -> tuple[float, ...]:
    """Least-squares polynomial of ``degree`` through the points; coefficients highest power first.

    Solves the normal equations on ``x / max|x|`` (which keeps them well conditioned for sequence lengths of
    tens of thousands) by Gaussian elimination with partial pivoting, then undoes the scaling.
    Needs at least ``degree + 1`` distinct x values; raises ``ValueError`` otherwise.
    """
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    if len(set(xs)) < degree + 1:
        raise ValueError(f"a degree-{degree} fit needs at least {degree + 1} distinct points, got {len(set(xs))}")
    scale = max(abs(x) for x in xs) or 1.0
    us = [x / scale for x in xs]
    size = degree + 1
    # normal equations: A[i][j] = sum u^(i+j), b[i] = sum y u^i, unknowns lowest power first
    matrix = [[sum(u ** (i + j) for u in us) for j in range(size)] for i in range(size)]
    rhs = [sum(y * u**i for u, y in zip(us, ys)) for i in range(size)]
    solution = _solve(matrix, rhs)
    return tuple(solution[power] / scale**power for power in reversed(range(size)))


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    size = len(rhs)
    rows = [[*row, value] for row, value in zip(matrix, rhs)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        if rows[pivot][col] == 0.0:
            raise ValueError("the points do not determine the fit (singular system)")
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, size + 1):
                rows[r][c] -= factor * rows[col][c]
    out = [0.0] * size
    for r in reversed(range(size)):
        out[r] = (rows[r][size] - sum(rows[r][c] * out[c] for c in range(r + 1, size))) / rows[r][r]
    return out
