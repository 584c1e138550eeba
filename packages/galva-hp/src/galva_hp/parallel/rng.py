"""Dropout random streams across parallel ranks: Megatron's RNG tracker, without state of its own.

Rule: where an activation is *replicated* over a group (plain tp outside the parallel matmuls), every rank draws the
same mask from the global RNG, which the same seed and the same sequence of random ops keep equal on every rank of
the group; where it is *sharded* (attention heads under tp or Ulysses, the sequence slice under Megatron-SP, Ulysses
or vocabulary sp), each rank draws from its own stream, so the shards get independent masks. The samples of a global
batch are sharded too: the runtime runs each module of a data-parallel replica in that replica's stream
(:func:`member_stream`), so replicas mask their samples independently, as one process masks every sample of the
batch (Megatron-LM gives data-parallel ranks one stream, which correlates the masks of their samples).

Inside a sharded region, an activation that is a partial sum the group reduces later (Swin's attention output
under Megatron-SP, masked before its window reverse) or a per-sample decision (drop path) draws from the stream the
group shares there (:func:`group_stream`): masking each rank's part alike masks the sum.

A sharded region forks the global RNG (CPU, and the tensor's CUDA device), seeds it from one number drawn from the
global CPU generator and this rank's index in the group, runs, and restores the global state advanced by that one
draw. Hence:

- reproducible from the seed: the per-rank stream is a function of the global RNG state, itself of the seed;
- identical draws on every rank of the group keep the global stream in step across ranks (each draws once);
- activation checkpointing replays the masks: ``torch.utils.checkpoint`` restores the global RNG state before
  recomputing, so the recomputation draws the same number and seeds the same per-rank stream. No tracker state
  needs saving beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.parallel.mappings import group_rank, group_size

__all__ = ["ShardedDropout", "group_stream", "member_stream", "rank_stream", "sharded_dropout"]

_MIX = 0x9E3779B97F4A7C15


def rank_stream(group: ProcessGroup | None, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Within the block, the global RNG (CPU and ``device``) is this rank's own stream for ``group``; afterwards it
    is the global stream advanced by one draw (the same on every rank of the group). ``group=None``: one rank."""
    return member_stream(group_rank(group), device)


_BASES: list[int] = []
"""The draw that seeded each open member stream, innermost last (the same on every member of its group)."""


@contextlib.contextmanager
def member_stream(index: int, device: torch.device) -> Iterator[None]:
    """:func:`rank_stream` for member ``index`` of a group: the ranks that share an index share the stream (the
    runtime gives each data-parallel replica of a module its own: ranks holding different samples)."""
    base = int(torch.randint(0, 2**62, (), generator=torch.default_generator))
    with _seeded((base * _MIX + index + 1) % (2**63), device):
        _BASES.append(base)
        try:
            yield
        finally:
            _BASES.pop()


@contextlib.contextmanager
def group_stream(device: torch.device, salt: int) -> Iterator[None]:
    """Inside a member stream: a stream every member of its group draws alike, for an activation replicated over
    the group there, or a partial sum the group reduces later (each rank's part masked alike is the sum masked).
    ``salt`` (>= 1) tells the uses within one member stream apart. Outside any: the global stream, shared already."""
    if not _BASES:
        yield
        return
    with _seeded((_BASES[-1] * _MIX - salt) % (2**63), device):  # members add index + 1: never the same seed
        yield


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def sharded_dropout(x: Tensor, p: float, group: ProcessGroup | None, training: bool = True) -> Tensor:
    """``F.dropout`` on an activation sharded over ``group``: each rank's own stream (the global one on one rank)."""
    if not training or p == 0.0:
        return x
    if group_size(group) == 1:
        return F.dropout(x, p, True)
    with rank_stream(group, x.device):
        return F.dropout(x, p, True)


class ShardedDropout(nn.Module):
    """``nn.Dropout(p)`` for an activation sharded over ``group``: a distinct, seed-reproducible mask per rank."""

    def __init__(self, p: float, group: ProcessGroup | None) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.group = float(p), group

    def forward(self, x: Tensor) -> Tensor:
        return sharded_dropout(x, self.p, self.group, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, ranks={group_size(self.group)}"
