"""Fits recover known coefficients and report residuals that reflect the points."""

from __future__ import annotations

import pytest

from galva_profiler.fitting import alpha_beta, polyfit, quadratic


def test_alpha_beta_recovers_a_line_and_reports_no_residual() -> None:
    fit = alpha_beta([1, 2, 4, 8], [3.5, 5.0, 8.0, 14.0])  # t = 1.5 x + 2
    assert fit.coefficients == pytest.approx((1.5, 2.0))
    assert fit.max_relative_residual == pytest.approx(0.0, abs=1e-12)


def test_residuals_show_points_off_the_line() -> None:
    fit = alpha_beta([1, 2, 3, 4], [1.0, 2.0, 3.0, 8.0])
    assert fit.residuals[-1] > 0 > fit.residuals[-2]
    assert fit.max_relative_residual > 0.1
    assert fit.to_dict()["rms_relative_residual"] == fit.rms_relative_residual


def test_quadratic_recovers_a_parabola() -> None:
    seqs = [128, 256, 512, 1024]
    fit = quadratic(seqs, [2e-6 * s * s + 0.01 * s + 0.5 for s in seqs])
    assert fit.coefficients == pytest.approx((2e-6, 0.01, 0.5), rel=1e-6)
    assert fit(2048) == pytest.approx(2e-6 * 2048**2 + 0.01 * 2048 + 0.5)


def test_too_few_points_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs 3 distinct points"):
        polyfit([1, 1, 2], [1, 2, 3], 2)


def test_timings_that_fall_with_the_batch_are_caught_for_retiming():
    from galva_profiler.layer_timing import PassTimes
    from galva_profiler.model_profile import unsteady_timing

    steady = {1: PassTimes(1.3, 2.6), 2: PassTimes(1.5, 3.0), 4: PassTimes(1.8, 3.6), 8: PassTimes(2.6, 5.2)}
    assert unsteady_timing(steady) is None
    # a load spike during the batch-1 and batch-4 timings (the shape of a discarded run in benchmarks/costmodel)
    spiked = {1: PassTimes(26.0, 52.0), 2: PassTimes(21.0, 42.0), 4: PassTimes(39.0, 78.0), 8: PassTimes(15.0, 30.0)}
    problem = unsteady_timing(spiked)
    assert problem is not None and "falls with the batch size" in problem
    assert unsteady_timing({4: PassTimes(1.0, 2.0)}) is None
    # the backward is priced from its own fit: a spike in it alone is caught too
    backward_spiked = {b: PassTimes(t.forward_ms, 60.0 / b) for b, t in steady.items()}
    assert "backward time falls" in (unsteady_timing(backward_spiked) or "")


def test_the_batch_sizes_of_a_fit_are_timed_round_robin_and_keep_their_own_median() -> None:
    """A drift of the machine's load falls on every point of the fit alike: each repetition (and warm-up) runs every
    batch size once, in turn; each size's median is of its own passes."""
    import torch

    from galva_profiler.layer_timing import time_interleaved
    from galva_profiler.timing import Repeats

    order: list[int] = []

    def forward(batch: int):  # type: ignore[no-untyped-def]
        weight = torch.ones(batch, 64, requires_grad=True)

        def run() -> torch.Tensor:
            order.append(batch)
            return (weight @ torch.ones(64, 64)).sum()

        return run

    times = time_interleaved({1: forward(1), 2: forward(2), 4: forward(4)}, Repeats(warmup=1, repetitions=3))
    assert order == [1, 2, 4] * 4
    assert sorted(times) == [1, 2, 4] and all(t.forward_ms > 0 and t.backward_ms > 0 for t in times.values())


def test_on_a_device_each_timed_pass_follows_an_untimed_one_of_its_own_shape() -> None:
    """A GPU step runs its layers at one shape, and a pass after another shape costs the host more there: off the
    CPU every timed pass of the round robin follows one of its own size (the CPU keeps the plain round robin, as
    the test above pins). The device only picks the clock and the synchronisation, so a CPU closure stands in."""
    import torch

    from galva_profiler.layer_timing import shape_lead, time_interleaved
    from galva_profiler.timing import Repeats

    order: list[int] = []

    def forward(batch: int):  # type: ignore[no-untyped-def]
        weight = torch.ones(batch, 8, requires_grad=True)

        def run() -> torch.Tensor:
            order.append(batch)
            return weight.sum()

        return run

    assert shape_lead(torch.device("cpu")) == 0 and shape_lead(torch.device("cuda")) == 1
    device = torch.device("meta")  # not the CPU; nothing runs on it
    time_interleaved({1: forward(1), 2: forward(2)}, Repeats(warmup=1, repetitions=2), device)
    assert order == [1, 2] + [1, 1, 2, 2] * 2
    order.clear()
    time_interleaved({1: forward(1)}, Repeats(warmup=0, repetitions=2), device)  # one shape: nothing to lead
    assert order == [1, 1]


def test_the_timed_rounds_go_on_until_they_span_the_given_seconds() -> None:
    """A shared machine changes speed in bursts of seconds: with ``span_s`` the rounds go on past the repetitions,
    whole rounds (every batch size alike), until the first timed round's start is that long ago; without it the
    repetitions alone."""
    import time

    import torch

    from galva_profiler.layer_timing import time_interleaved
    from galva_profiler.timing import Repeats

    order: list[int] = []

    def forward(batch: int):  # type: ignore[no-untyped-def]
        weight = torch.ones(batch, 8, requires_grad=True)

        def run() -> torch.Tensor:
            order.append(batch)
            time.sleep(0.01)
            return weight.sum()

        return run

    start = time.perf_counter()
    time_interleaved({1: forward(1), 2: forward(2)}, Repeats(warmup=0, repetitions=2), span_s=0.3)
    assert time.perf_counter() - start >= 0.3
    assert len(order) > 4 and len(order) % 2 == 0 and order[::2] == [1] * (len(order) // 2)
    order.clear()
    time_interleaved({1: forward(1), 2: forward(2)}, Repeats(warmup=0, repetitions=2))
    assert order == [1, 2, 1, 2]
