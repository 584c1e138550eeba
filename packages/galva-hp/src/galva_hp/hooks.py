"""Measurements of a training step: wall time, peak memory of the stage, bytes autograd saves per layer.

- Saved-activation bytes come from :func:`torch.autograd.graph.saved_tensors_hooks`: every tensor autograd keeps
  for backward is counted once per storage (views of one storage, and a parameter saved by several ops, count once;
  parameters and views of parameters, such as the ``weight.t()`` that ``nn.Linear``'s matmul saves, are excluded:
  they are model states, so the number is activations only).
- Peak memory is the device's own counter where it keeps one (CUDA: ``max_memory_allocated``); on CPU it is the
  process's peak resident set (``ru_maxrss``), which only grows, so it is a high-water mark, not a per-step value.
- Base memory is what the process holds before the model exists (CUDA: device memory in use outside the allocator,
  the context and communicator buffers; CPU: the resident set); :func:`peak_above_base_mib` is the peak on the
  same footing on both (CUDA: the allocator's peak; CPU: the resident high-water mark less the base).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "SavedActivationMeter",
    "StepMetrics",
    "Timer",
    "base_memory_mib",
    "peak_above_base_mib",
    "peak_memory_mib",
    "saved_activation_meter",
]


@dataclass
class StepMetrics:
    """What one training step reports (the same loss on every rank)."""

    loss: float
    tokens: int
    grad_norm: float | None = None
    lr: float | None = None
    step_ms: float | None = None
    peak_memory_mib: float | None = None
    saved_activation_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class SavedActivationMeter:
    """Bytes of distinct storages autograd saved while the meter was active."""

    bytes: int = 0
    _seen: set[int] = field(default_factory=set)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(tensor) and not tensor.is_meta:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += storage.nbytes()
        return tensor


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (``nn.Linear`` saves ``weight.t()``, a view sharing the weight's storage)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


@contextmanager
def saved_activation_meter() -> Iterator[SavedActivationMeter]:
    """Count the bytes autograd saves for backward inside the block."""
    meter = SavedActivationMeter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        yield meter


def peak_memory_mib() -> float | None:
    """Peak memory of this process's device, in MiB (see the module docstring for what CPU reports)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def base_memory_mib() -> float:
    """Memory this process holds outside the model's tensors, in MiB (call it before building the model; where CUDA
    is available the job computes there, so its context is created here if it is not yet)."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return (total - free - torch.cuda.memory_reserved()) / 2**20
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):  # not Linux: the high-water mark so far
        return peak_memory_mib() or 0.0


def peak_above_base_mib(base_mib: float) -> float | None:
    """The peak over ``base_mib`` (what :func:`base_memory_mib` returned before the model was built)."""
    peak = peak_memory_mib()
    if peak is None:
        return None
    if torch.cuda.is_available():
        return peak  # the allocator starts from nothing: its peak is above the base already
    return max(0.0, peak - base_mib)


class Timer:
    """Wall time of a block in milliseconds (synchronising the device first where there is one)."""

    def __enter__(self) -> Timer:
        _sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        _sync()
        self.ms = (time.perf_counter() - self._start) * 1e3


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
