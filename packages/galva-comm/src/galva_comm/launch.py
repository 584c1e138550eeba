"""Start the ranks of a one-machine job ourselves, as ``torchrun --standalone`` does, but end with one line.

``torchrun`` answers any failed rank, a user's bad flag included, with its own traceback and a failure table after
the rank's message. The commands that take ``--nproc-per-node`` (``galva-train``, ``galva-profile hardware|check``)
check their arguments once in the launching process, then call :func:`launch_local`: the ranks run under
torch's elastic agent (the same rendezvous, environment and signal handling as ``torchrun``), its logging is kept
quiet, and a failure becomes one line naming the first failed rank and its exit code; the rank's own message is
already above it. Ctrl-C or SIGTERM of the launching process is passed on to the ranks by the agent; their rank 0
says so in one line (:mod:`galva_schema.interrupt`) and the job's status is 128 + the signal. Multi-node jobs keep
using ``torchrun``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from galva_schema.interrupt import NOTE_ENV, SIGNALS, exit_status, interrupted_line

__all__ = ["LaunchError", "init_single_rank_group", "launch_local", "running_under_launcher"]

_SIGNALS = {int(s) for s in signal.Signals}
_AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_INTERRUPTED = {exit_status(s) for s in SIGNALS}


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

    0 when every rank exits 0; otherwise the exit code of the first rank that failed, whose message is already on
    stderr. A rank killed by a signal (the out-of-memory killer, an operator) says nothing itself: then one line
    ``PROG: rank R was killed by SIGNAL`` and the code ``128 + signal``, as a shell reports it. SIGINT or SIGTERM
    of this process: the agent passes it on to the ranks, the first of them to handle it says so in one line
    (:func:`galva_schema.interrupt.say_interrupted`; this process when none did), and the code is ``128 + signal``.
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
    # the first rank to say that the job was interrupted creates this file; the others, and this process, stay quiet
    note = Path(tempfile.gettempdir()) / f"galva-interrupted-{config.run_id}"
    os.environ[NOTE_ENV] = str(note)
    try:
        elastic_launch(config, sys.executable)("-u", "-m", module, *args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode >= 0:
            if failure.exitcode in _INTERRUPTED and not note.exists():  # a rank alone got the signal
                name = signal.Signals(failure.exitcode - 128).name
                print(f"{prog}: rank {rank} was interrupted ({name})", file=sys.stderr, flush=True)
            return failure.exitcode or 1  # the rank said why on its way out
        name = signal.Signals(-failure.exitcode).name if -failure.exitcode in _SIGNALS else str(-failure.exitcode)
        print(f"{prog}: rank {rank} was killed by {name}", file=sys.stderr, flush=True)
        return 128 - failure.exitcode
    except SignalException as err:  # the agent passed the signal on to the ranks and waited for them
        if not note.exists():  # no rank said it (they had finished, or were still starting): say it here
            print(interrupted_line(prog, err.sigval), file=sys.stderr, flush=True)
        return exit_status(err.sigval)
    except Exception as err:  # rendezvous or start-up failure of the agent, not of a rank
        raise LaunchError(f"cannot start {nproc} ranks: {err}") from err
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        os.environ.pop(NOTE_ENV, None)
        note.unlink(missing_ok=True)
        if threading.current_thread() is threading.main_thread():
            for signum, handler in handlers.items():
                if handler is not None:
                    signal.signal(signum, handler)
    return 0
