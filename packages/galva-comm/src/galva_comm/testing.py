"""Run a function on N forked gloo ranks, with a timeout, and report the failing rank with its traceback.

Every distributed test in Galva uses :func:`run_distributed`. Ranks are started with ``fork`` (about 0.1 s for four
ranks on two cores, against seconds for ``spawn``), each initialises a gloo process group whose collectives time
out, and the parent never waits longer than ``timeout`` seconds in total.

Robust on a loaded machine: the parent hosts the rendezvous store (as torchrun's agent does) on a port the OS gives
it, so no rank's exit takes the store away from ranks still creating groups and no other process can take the port
between choosing and binding it; and a rank that finished tears its connections down only after every rank has
finished (a store barrier), so a fast rank never closes a gloo pair that a slow peer still reads from.

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
    """One or more ranks failed or did not finish in time. The message names them, with the first traceback;
    ``summary`` says it in one line (the first rank to fail and its exception: its traceback's last line)."""

    def __init__(self, message: str, failed_ranks: list[int], summary: str | None = None) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        self.summary = summary or (message.splitlines() or [""])[0]


def free_port() -> int:
    """A TCP port on localhost that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _store_barrier(store: Any, key: str, world_size: int, timeout: float) -> None:
    """Wait (at most ``timeout`` s) until ``world_size`` ranks have added themselves to ``key`` in ``store``."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while int(store.add(key, 0)) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)


def _child(
    rank: int,
    world_size: int,
    port_pipe: Any,
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
        from galva_schema.interrupt import forked_worker

        forked_worker()  # Ctrl-C and SIGTERM are the parent's: it stops every rank (terminate) and says it once
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if not port_pipe.poll(max(5.0, timeout)):
            raise RuntimeError("the parent never sent the rendezvous store's port")
        port = int(port_pipe.recv())
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        pg_timeout = timedelta(seconds=max(5.0, timeout))
        store = dist.TCPStore("127.0.0.1", port, world_size, False, pg_timeout)  # the parent hosts it
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=pg_timeout, store=store)
        try:
            result = fn(rank, world_size, *args, **kwargs)
            # every rank done before any tears its gloo pairs down (a slow peer may still be reading from them)
            _store_barrier(store, "galva_testing/finished", world_size, max(5.0, timeout))
            report("ok", result)
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
    import torch.distributed as dist

    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, pipes[rank][0], timeout, fn, args, kwargs, queue, threads_per_rank),
            name=f"galva-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    from galva_schema.interrupt import forking

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    started: list[Any] = []
    store = None
    try:  # from the first fork: a signal held back while forking is raised as the block ends, and must end the ranks
        with forking():  # no rank runs this process's signal handlers (see _child)
            for proc in procs:
                proc.start()
                started.append(proc)
        # The rendezvous store lives in this process, on a port the OS picked (no race for a port chosen earlier),
        # and outlives every rank (a rank-0-hosted store vanished under ranks still creating groups when rank 0
        # finished first). It starts after the forks: its server thread must not be copied mid-operation into the
        # children.
        store_timeout = timedelta(seconds=max(5.0, timeout))
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, store_timeout, wait_for_workers=False)
        for _, sender in pipes:
            sender.send(int(store.port))
        deadline = time.monotonic() + timeout
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
        for proc in started:
            if proc.is_alive():
                proc.terminate()
        for proc in started:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for receiver, sender in pipes:
            receiver.close()
            sender.close()
        del store  # stop its server thread now, not when a traceback holding this frame is collected

    if errors:
        # dicts keep arrival order: the first rank to report a failure is the root cause, the others
        # usually fail because it left a collective
        first = next(iter(errors))
        names = ", ".join(str(r) for r in sorted(errors))
        cause = ([line for line in errors[first].splitlines() if line.strip()] or ["no message"])[-1]
        raise DistributedTestError(
            f"rank(s) {names} failed; first to fail was rank {first}:\n{errors[first]}", sorted(errors),
            summary=f"rank {first}: {cause.strip()}",
        )
    return [results[rank] for rank in range(world_size)]
