"""Run a function on N forked gloo ranks, with a timeout, and report the failing rank with its traceback.

Every distributed test in Galva uses :func:`run_distributed`. Ranks are started with ``fork`` (about 0.1 s for four
ranks on two cores, against seconds for ``spawn``), each initialises a gloo process group whose collectives time
out, and the parent never waits longer than ``timeout`` seconds in total.

    def check(rank: int, world_size: int, scale: float) -> float:
        t = torch.full((1,), float(rank))
        dist.all_reduce(t)
        return t.item() * scale

    assert run_distributed(check, 4, 2.0) == [12.0] * 4
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["DistributedTestError", "free_port", "run_distributed"]


class DistributedTestError(RuntimeError):
    """One or more ranks failed or did not finish in time. The message names them, with the first traceback."""

    def __init__(self, message: str, failed_ranks: list[int]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


def free_port() -> int:
    """A TCP port on localhost that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    queue: Any,
    threads: int,
) -> None:
    reported = False

    def report(status: str, payload: Any) -> None:
        nonlocal reported
        if reported:
            return
        reported = True
        try:
            queue.put((rank, status, payload))
        except Exception:
            detail = traceback.format_exc()
            queue.put((rank, "error", f"result could not be sent to the parent (not picklable?):\n{detail}"))

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=max(5.0, timeout)))
        try:
            report("ok", fn(rank, world_size, *args, **kwargs))
        except BaseException:
            # report before tearing the group down: the peers fail as soon as it goes, and the parent names the
            # first rank to report as the root cause
            report("error", traceback.format_exc())
        finally:
            # a failed collective can leave the group unusable; the error reported above matters more
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    except BaseException:  # report everything, including SystemExit and assertion errors
        report("error", traceback.format_exc())
    finally:
        # skip the parent's atexit handlers (pytest's among them), which fork copied into this process
        os._exit(0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads_per_rank: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked gloo ranks; return each rank's result.

    ``fn`` and its results must be picklable (results travel back through a pipe). A rank that raises makes this
    raise :class:`DistributedTestError` naming the rank, with its traceback; the other ranks are then terminated
    rather than left waiting in a collective. If the ranks are not all done after ``timeout`` seconds, the ones
    still running are named and terminated.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, port, timeout, fn, args, kwargs, queue, threads_per_rank),
            name=f"galva-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            if not queue.empty():
                rank, status, payload = queue.get()
                (results if status == "ok" else errors)[rank] = payload
                if errors:
                    # give the other ranks a moment to report their own failures, then stop waiting
                    grace = time.monotonic() + 2.0
                    while time.monotonic() < grace and len(results) + len(errors) < world_size:
                        if not queue.empty():
                            rank, status, payload = queue.get()
                            (results if status == "ok" else errors)[rank] = payload
                        else:
                            time.sleep(0.01)
                    break
                continue
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in errors]
            if dead and queue.empty():
                time.sleep(0.2)  # a result may still be in flight
                if queue.empty():
                    for r in dead:
                        errors[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting a result"
                    break
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise DistributedTestError(
                    f"ranks {missing} did not finish within {timeout:.0f} s (a hung collective?)", missing
                )
            time.sleep(0.005)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    if errors:
        # dicts keep arrival order: the first rank to report a failure is the root cause, the others
        # usually fail because it left a collective
        first = next(iter(errors))
        names = ", ".join(str(r) for r in sorted(errors))
        raise DistributedTestError(
            f"rank(s) {names} failed; first to fail was rank {first}:\n{errors[first]}", sorted(errors)
        )
    return [results[rank] for rank in range(world_size)]
