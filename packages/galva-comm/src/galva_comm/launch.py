"""Start the ranks of a one-machine job ourselves, as ``torchrun --standalone`` does, but end with one line.

``torchrun`` answers any failed rank, a user's bad flag included, with its own traceback and a failure table after
the rank's message. The commands that take ``--nproc-per-node`` (``galva-train``, ``galva-profile hardware|check``)
check their arguments once in the launching process, then call :func:`launch_local`: the ranks run under
torch's elastic agent (the same rendezvous, environment and signal handling as ``torchrun``), its logging is kept
quiet, and a failure becomes one line naming the first failed rank and its exit code; the rank's own message is
already above it. Multi-node jobs keep using ``torchrun``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from datetime import timedelta

__all__ = ["LaunchError", "init_single_rank_group", "launch_local", "running_under_launcher"]

_SIGNALS = {int(s) for s in signal.Signals}


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


def launch_local(nproc: int, module: str, args: Sequence[str], *, prog: str) -> int:
    """Run ``python -m module *args`` as ``nproc`` ranks on this machine; return the job's exit code.

    0 when every rank exits 0; otherwise the exit code of the first rank that failed, whose message is already on
    stderr. A rank killed by a signal (the out-of-memory killer, an operator) says nothing itself: then one line
    ``PROG: rank R was killed by SIGNAL`` and the code ``128 + signal``, as a shell reports it.
    """
    if nproc < 1:
        raise LaunchError(f"--nproc-per-node must be >= 1, got {nproc}")
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
    elastic = logging.getLogger("torch.distributed.elastic")
    level, elastic.level = elastic.level, logging.CRITICAL  # the agent's own warnings and failure table
    try:
        elastic_launch(config, sys.executable)("-u", "-m", module, *args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode or 1  # the rank said why on its way out
        name = signal.Signals(-failure.exitcode).name if -failure.exitcode in _SIGNALS else str(-failure.exitcode)
        print(f"{prog}: rank {rank} was killed by {name}", file=sys.stderr, flush=True)
        return 128 - failure.exitcode
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as err:  # rendezvous or start-up failure of the agent, not of a rank
        raise LaunchError(f"cannot start {nproc} ranks: {err}") from err
    finally:
        elastic.setLevel(level)
    return 0
