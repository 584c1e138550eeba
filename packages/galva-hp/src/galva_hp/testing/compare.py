"""Comparisons used by galva-hp's correctness tests (parallel result vs single-process oracle)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["assert_rel_close", "assert_states_close", "named_grads", "relative_error"]


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """``||actual - expected|| / ||expected||`` (Frobenius, in float64; absolute error when expected is 0)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / scale if scale > 0 else diff


def assert_rel_close(
    actual: Tensor, expected: Tensor, tol: float = 1e-5, what: str = "tensor", atol: float = 0.0
) -> None:
    """Shapes equal and ``||actual - expected|| <= tol * ||expected|| + atol``.

    ``atol`` (a norm) is for tensors whose exact value is zero, where only rounding noise is left to compare
    (e.g. the gradient of a key bias: softmax is invariant to it).
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    diff = (actual.detach().double() - expected.detach().double()).norm().item()
    scale = expected.detach().double().norm().item()
    if not diff <= tol * scale + atol:  # also catches NaN
        raise AssertionError(
            f"{what}: error {diff:.3e} (relative {relative_error(actual, expected):.3e}) > {tol:.0e} * {scale:.3e}"
            f" + {atol:.0e}"
        )


def assert_states_close(
    actual: Mapping[str, Tensor],
    expected: Mapping[str, Tensor],
    tol: float = 1e-5,
    what: str = "state",
    atol: float = 0.0,
) -> None:
    """Same names, and every tensor close (see :func:`assert_rel_close`)."""
    if set(actual) != set(expected):
        raise AssertionError(f"{what}: names differ: {sorted(set(actual) ^ set(expected))}")
    for name in expected:
        assert_rel_close(actual[name], expected[name], tol, f"{what} {name}", atol)


def named_grads(module: torch.nn.Module) -> dict[str, Tensor]:
    """``{name: grad}`` of a module's parameters (zeros where there is none)."""
    return {
        n: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()
    }
