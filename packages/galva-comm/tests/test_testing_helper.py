"""The multi-process helper every distributed test relies on: results, failures with tracebacks, timeouts."""

from __future__ import annotations

import time

import pytest

from galva_comm.testing import DistributedTestError, run_distributed


def _all_reduce_rank(rank: int, world_size: int, scale: float) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return float(value.item()) * scale


def _fail_on_rank_two(rank: int, world_size: int) -> int:
    if rank == 2:
        raise AssertionError("rank two disagrees")
    import torch.distributed as dist

    dist.barrier()  # the healthy ranks block here; the helper must not wait for them forever
    return rank


def _sleep_forever(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(3600)


@pytest.mark.distributed
def test_results_come_back_in_rank_order() -> None:
    assert run_distributed(_all_reduce_rank, 4, 2.0) == [12.0] * 4


@pytest.mark.distributed
def test_failing_rank_is_named_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank_two, 4, timeout=120)
    assert 2 in info.value.failed_ranks
    assert "rank two disagrees" in str(info.value)
    # the one line galva-profile check prints: the first rank to fail and its traceback's last line
    assert info.value.summary == "rank 2: AssertionError: rank two disagrees"
    assert time.monotonic() - start < 90  # the healthy ranks' barrier is abandoned, not waited out


@pytest.mark.distributed
def test_hung_rank_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"did not finish within 8 s") as info:
        run_distributed(_sleep_forever, 2, timeout=8)  # rank 1 never ends, whatever the limit
    assert 1 in info.value.failed_ranks  # (rank 0 may be named too on a loaded machine: it waits for rank 1)
    assert "\n" not in info.value.summary and "did not finish within 8 s" in info.value.summary
    assert time.monotonic() - start < 40


class _Interrupted(Exception):
    pass


@pytest.mark.distributed
def test_an_interrupt_while_the_ranks_fork_ends_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that lands while the ranks are forked is held back until the forks are done, then raised here: the
    ranks already started are ended with it, not left behind (CI: a Ctrl-C'd model profile left one)."""
    import contextlib
    import multiprocessing
    import os
    import signal

    from galva_schema import interrupt

    real = interrupt.forking

    @contextlib.contextmanager
    def forking_under_a_ctrl_c():  # type: ignore[no-untyped-def]
        with real():
            yield
            os.kill(os.getpid(), signal.SIGINT)  # blocked here: delivered as the real block ends

    def handler(signum: int, frame: object) -> None:
        raise _Interrupted

    monkeypatch.setattr(interrupt, "forking", forking_under_a_ctrl_c)
    previous = signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(_Interrupted):
            run_distributed(_sleep_forever, 2, timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [p.name for p in multiprocessing.active_children() if p.name.startswith("galva-rank-")] == []
