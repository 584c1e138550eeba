"""The memory one rank's process holds before any model is built: what galva-search reserves per device.

On GPU: device memory in use that the caching allocator does not account for (the CUDA context, the kernels loaded
on first use, and where there are several ranks the communicator's buffers, which exist after the first collective),
plus what stays allocated in the allocator after a first step (the cuBLAS workspaces). On CPU: the process's
resident set, with the training runtime imported where it is installed (galva-train's modules, the tensor-parallel
layers and a model family's code: most of a CPU process's base) and one small transformer-like training step run
(embedding, attention, norm, activation, loss, backward, AdamW, a collective), so the library code every job pages
in on its first step counts as base, not as model memory. Measured on every rank after the process group exists; the
profile keeps the largest.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import resource
import sys
import warnings

import torch
import torch.distributed as dist

from galva_profiler.distributed import World, max_over_ranks, synchronize

MIB = float(2**20)
# what a training process imports besides torch (galva-train's stack); the ones installed are imported first
RUNTIME_MODULES = (
    "galva_models.cli.train",
    "galva_hp.build",
    "galva_ckpt",
    "megatron.core.tensor_parallel",
    "transformers.models.llama.modeling_llama",
)


def resident_mib() -> float:
    """This process's resident set now, in MiB (Linux ``/proc/self/statm``; the peak ``ru_maxrss`` elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / MIB
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / MIB if sys.platform == "darwin" else peak / 1024.0


def import_runtime(modules: tuple[str, ...] = RUNTIME_MODULES) -> None:
    """Import those of ``modules`` that are installed (their import-time notices silenced); megatron-core's as a
    rank imports them (``galva_hp.megatron_import``, where galva-hp is installed: without torch's inductor, 42 MiB
    of a CPU rank's resident set)."""
    for name in modules:
        try:
            if importlib.util.find_spec(name.split(".")[0]) is not None:
                with warnings.catch_warnings():  # their import-time notices belong to the training job's log
                    warnings.simplefilter("ignore")
                    _import(name)
        except ImportError:  # a partial install: the base is then what this process could import
            continue


def _import(name: str) -> None:
    if name.startswith("megatron.") and importlib.util.find_spec("galva_hp") is not None:
        importlib.import_module("galva_hp.megatron_import").import_megatron(name)
    else:
        importlib.import_module(name)


def _warm_up(device: torch.device, collective: bool = True) -> None:
    """One small transformer-like training step and (``collective``) one collective: the code every job runs on its
    first step."""
    import torch.nn.functional as F

    batch, seq, heads, head_dim, vocab = 2, 16, 2, 16, 64
    hidden = heads * head_dim
    embedding = torch.nn.Embedding(vocab, hidden, device=device)
    proj = torch.nn.Linear(hidden, 3 * hidden, device=device)
    head = torch.nn.Linear(hidden, vocab, device=device)
    tokens = torch.randint(0, vocab, (batch, seq), device=device)
    x = F.layer_norm(embedding(tokens), (hidden,))
    q, k, v = proj(x).view(batch, seq, 3, heads, head_dim).unbind(2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    y = F.silu(y.transpose(1, 2).reshape(batch, seq, hidden)) * F.gelu(x)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    F.cross_entropy(head(y).view(-1, vocab), tokens.view(-1)).backward()
    params = [*embedding.parameters(), *proj.parameters(), *head.parameters()]
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.optim.AdamW(params).step()
    if collective:
        dist.all_reduce(torch.ones(1024, device=device))
    synchronize(device)


def measure_base_memory(world: World, modules: tuple[str, ...] = RUNTIME_MODULES) -> float:
    """Base memory per rank in MiB, the largest over ranks (the same value on every rank; collective); on CPU after
    importing ``modules`` (those installed)."""
    if world.device.type != "cuda":
        import_runtime(modules)
    # a one-rank job communicates with nobody: on one H100 the collective's communicator alone held 548 MiB that
    # such a job's training never did (1315 against 767 MiB)
    _warm_up(world.device, collective=world.size > 1)
    if world.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(world.device)
        # outside the allocator, and what the warm-up left allocated in it (the cuBLAS workspaces, which live as long
        # as their handles: a job's allocator peak counts them, the model profile's bytes do not)
        held = torch.cuda.memory_reserved(world.device) - torch.cuda.memory_allocated(world.device)
        used = (total - free - held) / MIB
        # ranks sharing one device each see the others' contexts too: this rank's share
        sharing = max(1, world.local_size // max(1, torch.cuda.device_count()))
        mine = used / sharing
    else:
        mine = resident_mib()
    return max_over_ranks(mine, world.device)
