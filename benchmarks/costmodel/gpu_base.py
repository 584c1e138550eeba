"""Where a one-rank GPU process's memory goes before the model: what `galva-profile hardware` calls the base.

    python benchmarks/costmodel/gpu_base.py        # on a GPU machine (tools/gpu_checks.sh runs it)

Prints, after each stage, the device memory in use outside the caching allocator and the allocator's allocated and
reserved bytes: the CUDA context; a process group; the profile's warm-up step without a collective (what a one-rank
job runs); one NCCL all-reduce (what a job of several ranks adds). On an NVIDIA H100 (torch 2.11.0+cu130): 619 MiB,
619, 751 + 65 allocated (the cuBLAS workspaces), 1315 after the all-reduce.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from galva_comm.testing import free_port
from galva_profiler.base_memory import _warm_up

MIB = 2**20


def show(stage: str) -> None:
    free, total = torch.cuda.mem_get_info()
    outside = (total - free - torch.cuda.memory_reserved()) / MIB
    allocated, reserved = torch.cuda.memory_allocated() / MIB, torch.cuda.memory_reserved() / MIB
    print(f"{stage:26s} outside the allocator {outside:7.1f} MiB, allocated {allocated:6.1f}, reserved {reserved:6.1f}")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_base.py: torch sees no CUDA device here")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    show("CUDA context")
    dist.init_process_group("nccl", rank=0, world_size=1)
    show("process group")
    _warm_up(torch.device("cuda"), collective=False)
    show("warm-up, no collective")
    dist.all_reduce(torch.ones(1024, device="cuda"))
    torch.cuda.synchronize()
    show("after an all-reduce")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
