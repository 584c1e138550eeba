"""A progress watchdog for a training job: no hang lasts longer than the collective timeout, and the line that ends
the job names the rank that stopped, its step and the collective the others waited in.

Every rank runs one daemon thread. It publishes a heartbeat to the job's rendezvous store (torchrun's, or whatever
``MASTER_ADDR:MASTER_PORT`` names) every ``interval`` seconds and at the top of every step (a rank stopped a moment
later is named at its real step): wall time, the step, the collective the rank is in (torch.distributed's calls
are intercepted while the watchdog runs: :mod:`galva_comm.intercept`) and when the rank last made progress. The
monitor ranks (the first and the last) read every rank's heartbeat. A rank is stuck when

* its heartbeat is older than ``timeout`` (the whole process stopped: SIGSTOP, a stalled node, a dead host), or
* no rank has made progress for ``timeout`` (a deadlock): the rank furthest behind (lowest step, then fewest
  collectives) is named.

Start-up (rendezvous, building the model, creating groups) runs under :func:`startup_timeout`, the larger of the
timeout and :data:`STARTUP_TIMEOUT_S`: ranks that import and build at different speeds on a loaded machine are not
stuck. :meth:`Watchdog.arm`, called before the first step, sets every process group's timeout to ``timeout``.

The monitor that sees it first (an atomic counter in the store) prints one line, ``PROG: error: rank R ...``; a stuck
rank on the same host as that monitor is killed (a stopped process would otherwise outlive the job: torchrun sends
SIGTERM, which a stopped process never handles); then every rank exits with :data:`EXIT_STUCK`. A collective that
fails in the main thread first (gloo's own timeout is the same number) goes through :meth:`Watchdog.fail`, which asks
the heartbeats the same question, so the line is the same whichever side notices first. Steps are named by the last
one completed (``after step 6``).

A rank that raises an exception of its own goes through :meth:`Watchdog.crash`: its traceback, then one line naming
the rank, its step and the exception (exit :data:`EXIT_FAILED`); the line is recorded in the store first, so a peer
whose collective fails next (the rank left it) reports that line, not itself, and only one rank prints.

Ctrl-C (SIGINT to every rank) and SIGTERM (what torchrun and galva-comm's launcher pass on) are read by the thread
through :func:`signal.set_wakeup_fd`, so they are seen even while the main thread waits in C++; one rank prints one line
(:func:`galva_schema.interrupt.say_interrupted`, with the step) and every rank exits with 128 + the signal (130 for
SIGINT, :data:`EXIT_INTERRUPTED`; 143 for SIGTERM), no traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from galva_comm.intercept import CALLS, Intercept
from galva_hp.heartbeat import Heartbeat, diagnose, step_text

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "EXIT_INTERRUPTED",
    "EXIT_STUCK",
    "STARTUP_TIMEOUT_S",
    "Heartbeat",
    "Watchdog",
    "diagnose",
    "startup_timeout",
]

DEFAULT_TIMEOUT_S = 600.0
"""Default collective timeout: longer than any step of a sane plan, far shorter than torch's 30 minutes."""
STARTUP_TIMEOUT_S = 300.0
"""Start-up allowance: how long ranks may wait for each other before the first step (at least the timeout)."""
EXIT_STUCK = 3
"""Exit status of every rank when the watchdog ends a job (a rank stopped making progress)."""
EXIT_FAILED = 1
"""Exit status of a rank that raised an exception of its own (:meth:`Watchdog.crash`)."""
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""

def startup_timeout(timeout_s: float) -> float:
    """The timeout of start-up (before the first step): the collective timeout, but at least 5 minutes."""
    return max(timeout_s, STARTUP_TIMEOUT_S)


class Watchdog:
    """See the module docstring. ``start()`` in the main thread after ``init_process_group``; ``step(n)`` at the top
    of every training step; ``fail(err)`` for a collective error; ``stop()`` at the end."""

    def __init__(self, *, rank: int, world_size: int, timeout_s: float, prog: str, interval_s: float | None = None):
        self.rank, self.world_size, self.timeout_s, self.prog = rank, world_size, float(timeout_s), prog
        self.interval_s = interval_s or max(0.2, min(1.0, self.timeout_s / 10))
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._step = 0
        self._collective: str | None = None
        self._collectives = 0
        self._progress_time = time.time()
        self._store: Any = None
        self._prefix = "galva_watchdog/{}/{}/".format(
            os.environ.get("TORCHELASTIC_RUN_ID", "none"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        )
        self._stop = threading.Event()
        self._poked = threading.Event()
        self._exiting = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._old_wakeup_fd = -1
        self._old_sigint: Any = None
        self._old_sigterm: Any = None
        self._intercept = Intercept(self._tracked, CALLS, key="galva-watchdog")

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> Watchdog:
        if self.world_size > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            import torch.distributed as dist

            self._store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                None,
                False,
                timedelta(seconds=max(5.0, min(30.0, self.timeout_s))),
            )
        self._intercept.install()
        if threading.current_thread() is threading.main_thread():
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
            # the main thread ignores Ctrl-C and SIGTERM (no exception from some random frame); the thread ends the run
            self._old_sigint = signal.signal(signal.SIGINT, lambda signum, frame: None)
            self._old_sigterm = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        self._publish()
        self._thread = threading.Thread(target=self._run, name="galva-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._intercept.remove()
        if self._wake_w is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._old_wakeup_fd)
            signal.signal(signal.SIGINT, self._old_sigint)
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._wake_w.close()
            assert self._wake_r is not None
            self._wake_r.close()
            self._wake_w = self._wake_r = None

    # ------------------------------------------------------------------------------------------------- progress
    def arm(self) -> None:
        """Before the first step: every process group (the world, galva-comm's) from now on times out after
        ``timeout`` seconds instead of the start-up allowance."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        timeout = timedelta(seconds=self.timeout_s)
        for group in list(dist.distributed_c10d._world.pg_map):
            with contextlib.suppress(ValueError, AssertionError, RuntimeError):
                dist.distributed_c10d._set_pg_timeout(timeout, group)

    def step(self, step: int) -> None:
        """Called at the top of training step ``step`` (1-based; step ``step - 1`` is complete)."""
        self._step = step
        self._progress_time = time.time()
        self._poke()  # published now: a rank stopped a moment later is named at this step, not one a second old

    def fail(self, err: BaseException) -> int:
        """A collective raised in the main thread: print, once for the job, the failure a peer recorded
        (:meth:`crash`), else the heartbeats' verdict, else the error; exit."""
        peer = self._peer_failure()
        verdict = peer or self._verdict(threshold=2.5 * self.interval_s + 1.0)
        if verdict is None:
            what = f"{self._collective or 'a collective'} failed: {_first_line(err)}"
            verdict = f"rank {self.rank} {step_text(self._step)}: {what}"
        # a peer that raised ends the job as failed (its status), whichever rank's exit the launcher sees first
        status = EXIT_FAILED if peer is not None else EXIT_STUCK
        self._end(verdict, status)
        return status  # not reached

    def crash(self, err: BaseException) -> int:
        """This rank raised ``err`` itself (not a failed collective): the job ends with one line naming this rank,
        where it was and the exception (after its traceback), exit status 1. The line is recorded in the store
        first, so that a peer whose collective fails next reports this, not itself."""
        verdict = f"rank {self.rank} {step_text(self._step)}: {type(err).__name__}: {_first_line(err)}"
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(self._prefix + "failure", verdict)
        self._end(verdict, EXIT_FAILED, cause=err)
        return EXIT_FAILED  # not reached

    def _peer_failure(self) -> str | None:
        """The line of a rank that raised (:meth:`crash`). It is recorded before that rank exits, and a peer's
        collective fails only once it has exited (closing its connections): no need to wait for it."""
        if self._store is None:
            return None
        key = self._prefix + "failure"
        try:
            return bytes(self._store.get(key)).decode() if self._store.check([key]) else None
        except Exception:
            return None

    # ------------------------------------------------------------------------------------------- the thread
    def _poke(self) -> None:
        """Wake the thread: it publishes the heartbeat now."""
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")  # never a signal number
        else:
            self._poked.set()

    def _run(self) -> None:
        monitor = self.rank in (0, self.world_size - 1)
        next_check = 0.0
        while not self._stop.is_set():
            if self._wake_r is not None:
                import select

                ready, _, _ = select.select([self._wake_r], [], [], self.interval_s)
                if ready:
                    with contextlib.suppress(OSError):
                        data = self._wake_r.recv(64)
                        signals = [s for s in data if s in (signal.SIGINT, signal.SIGTERM)]
                        if signals:
                            self._interrupted(signals[0])
            else:
                self._poked.wait(self.interval_s)
                self._poked.clear()
            if self._stop.is_set():
                return
            try:
                self._publish()
                if monitor and time.monotonic() >= next_check:  # every interval, however often it was poked
                    next_check = time.monotonic() + self.interval_s
                    verdict = self._verdict(threshold=self.timeout_s, startup=startup_timeout(self.timeout_s))
                    if verdict is not None:
                        self._end(verdict, EXIT_STUCK)
            except Exception as err:  # the store went away: its host (torchrun's agent or rank 0) is gone
                if self._stop.is_set():
                    return
                where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
                self._end(
                    f"rank {self.rank} {step_text(self._step)}: lost the rendezvous store at {where} "
                    f"({(str(err).splitlines() or [type(err).__name__])[0]})",
                    EXIT_STUCK,
                    quiet_unless_first=False,
                )

    def _publish(self) -> None:
        if self._store is None:
            return
        beat = Heartbeat(
            self.rank,
            time.time(),
            self._progress_time,
            self._step,
            self._collective,
            self._collectives,
            self.host,
            self.pid,
        )
        self._store.set(self._prefix + str(self.rank), beat.to_json())

    def _beats(self) -> dict[int, Heartbeat]:
        keys = [self._prefix + str(r) for r in range(self.world_size)]
        present = [k for k in keys if self._store.check([k])]
        values = self._store.multi_get(present) if present else []
        return {int(k.rsplit("/", 1)[1]): Heartbeat.from_json(v) for k, v in zip(present, values)}

    def _verdict(self, threshold: float, startup: float | None = None) -> str | None:
        if self._store is None:
            return None
        try:
            beats = self._beats()
        except Exception:
            return None
        verdict = diagnose(beats, self.world_size, time.time(), threshold, startup)
        if verdict is not None:
            self._kill_stopped_local_rank(beats, threshold)
        return verdict

    def _kill_stopped_local_rank(self, beats: dict[int, Heartbeat], threshold: float) -> None:
        """A stuck rank whose whole process stopped (stale heartbeat) on this host: SIGKILL it, the one signal a
        stopped process obeys, so the job leaves nothing behind."""
        now = time.time()
        for beat in beats.values():
            if beat.rank != self.rank and beat.host == self.host and now - beat.time > threshold:
                with contextlib.suppress(OSError):
                    os.kill(beat.pid, signal.SIGKILL)

    # --------------------------------------------------------------------------------------------------- endings
    def _end(
        self, verdict: str, code: int, quiet_unless_first: bool = True, cause: BaseException | None = None
    ) -> None:
        """Print ``verdict`` if this is the first rank to end the job, then exit this process with ``code``.
        ``cause``: this rank's own exception, whose traceback goes above the line."""
        if not self._exiting.acquire(blocking=False):
            time.sleep(3600)  # another thread of this process is already exiting
        first = True
        if self._store is not None and quiet_unless_first:
            try:
                first = int(self._store.add(self._prefix + "abort", 1)) == 1
            except Exception:
                first = self.rank == 0
        if first and cause is not None:
            import traceback

            traceback.print_exception(type(cause), cause, cause.__traceback__, file=sys.stderr)
            print(f"{self.prog}: error: {verdict}", file=sys.stderr, flush=True)
        elif first:
            line = f"{self.prog}: error: {verdict}; collective timeout {self.timeout_s:g} s (--collective-timeout)"
            print(line, file=sys.stderr, flush=True)
        _exit(code)

    def _interrupted(self, signum: int) -> None:
        from galva_schema.interrupt import exit_status, say_interrupted

        if not self._exiting.acquire(blocking=False):
            return
        ended = False  # a rank already ended the job with its line (the launcher then stops the others: SIGTERM)
        if self._store is not None:
            with contextlib.suppress(Exception):
                ended = int(self._store.add(self._prefix + "abort", 0)) > 0
        if not ended:
            say_interrupted(self.prog, signum, f" {step_text(self._step)}")  # one rank of the job says it
        _exit(exit_status(signum))

    # ------------------------------------------------------------------------------------- collective tracking
    def _tracked(self, name: str, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of torch.distributed (:class:`galva_comm.intercept.Intercept`): named while it runs."""
        size = _group_size(kwargs.get("group"))
        self._collective = name if size is None else f"{name} (group of {size})"
        self._collectives += 1
        self._progress_time = time.time()
        try:
            return call(*args, **kwargs)
        finally:
            self._collective = None
            self._progress_time = time.time()


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _group_size(group: Any) -> int | None:
    if group is None:
        return None
    try:
        import torch.distributed as dist

        return int(dist.get_world_size(group))
    except Exception:
        return None


def _exit(code: int) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
