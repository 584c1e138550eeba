"""The memory one rank's process holds before any model is built: what galva-search reserves per device.

On GPU: device memory in use that the caching allocator does not account for (the CUDA context, cuBLAS workspaces
and the communicator's buffers, which exist after the first collective). On CPU: the process's resident set, with
the training runtime imported where it is installed (its libraries are most of a CPU process's base) and one small
forward, backward and AdamW step run, so the BLAS and autograd code the job pages in is counted as base, not as
model memory. Measured on every rank after the process group exists; the profile keeps the largest.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import resource
import sys

import torch
import torch.distributed as dist

from galva_profiler.distributed import World, max_over_ranks, synchronize

MIB = float(2**20)
# what a training process imports besides torch (galva-train's stack); the ones installed are imported first
RUNTIME_MODULES = ("galva_hp", "galva_models", "transformers.modeling_utils")


def resident_mib() -> float:
    """This process's resident set now, in MiB (Linux ``/proc/self/statm``; the peak ``ru_maxrss`` elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / MIB
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / MIB if sys.platform == "darwin" else peak / 1024.0


def _import_runtime() -> None:
    for name in RUNTIME_MODULES:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)


def _warm_up(device: torch.device) -> None:
    """One small training step and one collective: the code paths every job runs before its first real step."""
    layer = torch.nn.Linear(256, 256, device=device)
    x = torch.randn(32, 256, device=device, requires_grad=True)
    torch.nn.functional.softmax(layer(x), dim=-1).sum().backward()
    torch.optim.AdamW(layer.parameters()).step()
    buf = torch.ones(1024, device=device)
    dist.all_reduce(buf)
    synchronize(device)


def measure_base_memory(world: World) -> float:
    """Base memory per rank in MiB, the largest over ranks (the same value on every rank; collective)."""
    if world.device.type != "cuda":
        _import_runtime()
    _warm_up(world.device)
    if world.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(world.device)
        used = (total - free - torch.cuda.memory_reserved(world.device)) / MIB
        # ranks sharing one device each see the others' contexts too: this rank's share
        sharing = max(1, world.local_size // max(1, torch.cuda.device_count()))
        mine = used / sharing
    else:
        mine = resident_mib()
    return max_over_ranks(mine, world.device)
