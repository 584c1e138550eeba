"""Joining the torchrun job: backend and device choice, the timeout every collective gets, agreement between ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from galva_profiler.errors import ProfileError


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    backend: str
    device: torch.device

    @property
    def num_nodes(self) -> int:
        return max(1, self.size // self.local_size)


def launched_world_size() -> int:
    """The world size torchrun set (1 when run without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_world(timeout_s: float, backend: str | None = None) -> World:
    """Join the process group torchrun describes: NCCL on GPUs, gloo on CPU; every collective times out.

    Raises :class:`ProfileError` when run without a launcher. A job of one rank (one GPU) measures what one
    device has: its base memory and optimizer rate; there is nothing to communicate.
    """
    size = launched_world_size()
    if "RANK" not in os.environ:
        raise ProfileError(
            "hardware profiling runs as the ranks of a job: give --nproc-per-node N (N ranks on this machine, 1 for "
            "one device) or launch it with torchrun, e.g. torchrun --nproc_per_node 4 -m galva_profiler.cli hardware"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return World(dist.get_rank(), dist.get_world_size(), local_rank, local_size, backend, device)


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` of any rank, known to every rank (a collective takes as long as its slowest rank)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_agree(ok: bool, device: torch.device) -> bool:
    """True on every rank when ``ok`` is true on every rank (used before anything is written)."""
    return max_over_ranks(0.0 if ok else 1.0, device) == 0.0


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU, where every op runs in the calling thread)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
