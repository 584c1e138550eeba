"""Start the ranks of a one-machine job ourselves, as ``torchrun --standalone`` does, but end with one line.

``torchrun`` answers any failed rank, a user's bad flag included, with its own traceback and a failure table after
the rank's message. The commands that take ``--nproc-per-node`` (``galva-train``, ``galva-profile hardware|check``)
check their arguments once in the launching process, then call :func:`launch_local`: the ranks run under
torch's elastic agent (the same rendezvous, environment and signal handling as ``torchrun``), its logging is kept
quiet, and a failed job ends with one line: the failed rank's own, or the launcher's naming it
(:func:`launch_local`, :func:`rank_failed`). Ctrl-C or SIGTERM of the launching process is passed on to the ranks by
the agent; the first rank to handle it leaves its line for the launcher (:mod:`galva_schema.interrupt`), which prints
it, and the job's status is 128 + the signal. Multi-node jobs keep using ``torchrun``.

A rank starts as ``python -m galva_comm.launch MODULE ARGS`` (:func:`_rank_main`) with SIGINT and SIGTERM held back
(blocked: the launching thread blocks them while the agent starts the ranks, and a started process inherits the
mask). Its first act is to install handlers that end it quietly, then let the signals in and run ``MODULE`` as
``__main__``: a Ctrl-C while a rank starts Python or imports torch, before the command's own handler
(:func:`galva_schema.interrupt.run_command`) is in place, ends it without a ``KeyboardInterrupt`` traceback, and the
launcher says the one line.
"""

from __future__ import annotations

import logging
import os
import runpy
import shutil
import signal
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from galva_schema.interrupt import NOTE_ENV, SIGNALS, exit_status, forking, interrupted_line

__all__ = [
    "FAILURE_ENV",
    "LaunchError",
    "init_single_rank_group",
    "is_collective_error",
    "launch_local",
    "rank_failed",
    "running_under_launcher",
]

_SIGNALS = {int(s) for s in signal.Signals}
_AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_INTERRUPTED = {exit_status(s) for s in SIGNALS}

FAILURE_ENV = "GALVA_FAILURE_NOTES"
"""Set by :func:`launch_local` for its ranks: a directory where :func:`rank_failed` leaves what the launcher says."""


class LaunchError(RuntimeError):
    """The ranks could not be started (bad ``--nproc-per-node``, rendezvous failure); the message is one line."""


def running_under_launcher() -> bool:
    """True inside a rank started by ``torchrun`` or :func:`launch_local` (they set ``RANK``/``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_single_rank_group(backend: str, timeout: timedelta) -> None:
    """The process group of a command run plainly, without a launcher (no ``RANK`` / ``WORLD_SIZE``): one rank,
    its rendezvous store in this process's memory, so no port is chosen, raced for or left open."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _elastic_logger_names() -> list[str]:
    names = [name for name in logging.root.manager.loggerDict if name.startswith("torch.distributed.elastic")]
    return ["torch.distributed.elastic", *names]


def launch_local(nproc: int, module: str, args: Sequence[str], *, prog: str) -> int:
    """Run ``python -m module *args`` as ``nproc`` ranks on this machine; return the job's exit code.

    0 when every rank exits 0. Otherwise the launcher is the job's one voice (a rank says only what it alone knows):

    * a rank that said why it failed (its own exception through :func:`rank_failed`, its own ``PROG: error: ...``
      line with another exit code): nothing more, that rank's exit code;
    * a rank killed by a signal (the out-of-memory killer, an operator) says nothing itself: one line
      ``PROG: rank R was killed by SIGNAL`` and the code ``128 + signal``, as a shell reports it;
    * only failed collectives (a stuck peer): the lowest such rank's line, recorded by :func:`rank_failed`;
    * SIGINT or SIGTERM of this process: the agent passes it on to the ranks; the line of the first rank to handle
      it (:func:`galva_schema.interrupt.say_interrupted`, with its detail) or this process's own, code ``128 +
      signal``. The ranks the agent stops after a failure are not interrupted: their notes are dropped.
    """
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node must be >= 1, got {nproc}")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # one OpenMP thread pool per core, not per rank (torchrun sets 1 and warns)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_endpoint="localhost:0",
        rdzv_backend="c10d",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    # the agent's own warnings ("Received 2 death signal"), failure table and tracebacks: each of its modules' loggers
    # has a level of its own
    loggers = [logging.getLogger(name) for name in _elastic_logger_names()]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    # the agent installs handlers that raise its SignalException and never puts the old ones back
    handlers = {s: signal.getsignal(s) for s in _AGENT_SIGNALS}
    # what the ranks leave for this process to say: the first interrupted rank's line, the failures
    notes = Path(tempfile.mkdtemp(prefix=f"galva-job-{config.run_id}-"))
    interrupted = notes / "interrupted"
    os.environ[NOTE_ENV] = str(interrupted)
    os.environ[FAILURE_ENV] = str(notes)
    # Python runs signal handlers in the main thread, whichever thread the signal is delivered to: this thread keeps
    # SIGINT and SIGTERM unblocked, so the agent still gets them while the main thread blocks them for the ranks
    receiver = threading.Event()
    threading.Thread(target=receiver.wait, name="galva-launch-signals", daemon=True).start()
    try:
        with forking():  # the ranks start with SIGINT and SIGTERM blocked; _rank_main lets them in
            elastic_launch(config, sys.executable)("-u", "-m", __name__, module, *args)
    except ChildFailedError as err:
        code, line = _failure(err.failures, notes, prog)
        if line:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as err:  # the agent passed the signal on to the ranks and waited for them
        # a rank's line (with its detail), or this process's when none said it (finished, or still starting)
        print(_read(interrupted) or interrupted_line(prog, err.sigval), file=sys.stderr, flush=True)
        return exit_status(err.sigval)
    except Exception as err:  # rendezvous or start-up failure of the agent, not of a rank
        raise LaunchError(f"cannot start {nproc} ranks: {err}") from err
    finally:
        receiver.set()
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        os.environ.pop(NOTE_ENV, None)
        os.environ.pop(FAILURE_ENV, None)
        shutil.rmtree(notes, ignore_errors=True)
        if threading.current_thread() is threading.main_thread():
            for signum, handler in handlers.items():
                if handler is not None:
                    signal.signal(signum, handler)
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def _failure(failures: dict[int, Any], notes: Path, prog: str) -> tuple[int, str]:
    """The exit code of a failed job and the line this process prints for it ("" when a rank said it)."""
    codes = {rank: failure.exitcode for rank, failure in sorted(failures.items())}
    if (notes / "said").exists():  # a rank raised, printed its traceback and line (rank_failed)
        return next((c for c in codes.values() if c > 0 and c not in _INTERRUPTED), 1), ""
    # the agent stops the other ranks of a failed job with SIGTERM, which ends a rank whose interpreter is already
    # shutting down (its handlers gone): a kill by SIGTERM explains the job only when nothing else does
    for rank, code in codes.items():
        if code < 0 and code != -signal.SIGTERM:
            return 128 - code, _killed(prog, rank, code)
    for rank, code in codes.items():
        if code > 0 and code not in _INTERRUPTED and not (notes / f"collective-{rank}").exists():
            return code, ""  # the rank said why on its way out (its own PROG: error: line)
    for rank in codes:
        line = _read(notes / f"collective-{rank}")
        if line:
            return codes[rank], line
    for rank, code in codes.items():
        if code < 0:
            return 128 - code, _killed(prog, rank, code)
    rank, code = next(iter(codes.items()))  # a rank alone got a signal
    if code in _INTERRUPTED:
        said = _read(notes / "interrupted")
        return code, said or f"{prog}: rank {rank} was interrupted ({signal.Signals(code - 128).name})"
    return code or 1, ""


def _killed(prog: str, rank: int, code: int) -> str:
    name = signal.Signals(-code).name if -code in _SIGNALS else str(-code)
    return f"{prog}: rank {rank} was killed by {name}"


def is_collective_error(err: BaseException) -> bool:
    """A failed or timed-out collective (a peer stopped, left or timed out), as opposed to a fault of this rank."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "timed out", "connection reset", "connection closed")
    )


def rank_failed(prog: str, err: Exception) -> int:
    """End a rank of a multi-rank command that has no watchdog of its own (galva-train has one) on ``err``: one line
    for the job, ``PROG: error: rank R: Type: message``; returns the exit status, 1.

    A failed collective is the consequence of a peer's end, or of a stuck peer: under :func:`launch_local` the line
    is left to the launcher, which says it only when no peer's end explains it (a peer that raised, said why, or was
    killed); under another launcher it is printed. Any other exception is this rank's own: its traceback, then the
    line, from the first rank of the job to fail only.
    """
    rank = os.environ.get("RANK", "0")
    what = (str(err).strip().splitlines() or [""])[0]
    line = f"{prog}: error: rank {rank}: {type(err).__name__}: {what}".rstrip(": ")
    notes = os.environ.get(FAILURE_ENV)
    if is_collective_error(err):
        if notes:
            try:
                Path(notes, f"collective-{rank}").write_text(line + "\n", encoding="utf-8")
                return 1
            except OSError:
                pass
        print(line, file=sys.stderr, flush=True)
        return 1
    if notes:
        try:
            os.close(os.open(Path(notes, "said"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return 1  # a peer failed first and said so
        except OSError:
            pass
    traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    print(line, file=sys.stderr, flush=True)
    return 1


def _quiet_exit(signum: int, frame: object) -> None:
    os._exit(exit_status(signum))  # the launcher, or a rank further on, says the line


def _rank_main(argv: Sequence[str]) -> None:
    """A rank's entry point, ``python -m galva_comm.launch MODULE ARGS``: a signal before ``MODULE``'s own handler
    ends the rank quietly with 128 + signal; then ``MODULE`` runs as ``__main__`` with ``ARGS``."""
    for signum in SIGNALS:
        signal.signal(signum, _quiet_exit)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # held back since the launcher started this process
    module, *args = argv
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
