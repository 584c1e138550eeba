"""The collectives a module's passes call, recorded with their buffers: what a parallel form does per micro-batch.

The cost model prices a parallel form's communication per call from the hardware profile's curves. For a layer it
knows the calls of each form (docs/cost-model.md §4); for the vocabulary's forms it counted two all-reduces of the
hidden state (tp) or one gather of the parameters (ZeRO-3), where galva-hp's vocabulary-parallel loss makes three more
of its own and ZeRO-3 wraps the embedding and the head as a unit each (on 2 gloo ranks of tiny-llama the plan with
the vocabulary at tp 2 measured 9.1 ms a step above the same plan at tp 1, priced 2.2; at ZeRO-3 19.7, priced 2.6).
So the profiler runs the form's forward and backward twice, at two batch sizes, with torch.distributed's collectives
intercepted (:class:`galva_comm.intercept.Intercept`, which sees galva-hp's mappings and FSDP2 alike), and keeps each
call's op and its buffer in bytes per sample and fixed (:func:`per_sample`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from galva_comm.intercept import COLLECTIVES, Intercept
from galva_schema import CollectiveCall

_GATHERS = {"all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_single"}
_SCATTERS = {"reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single"}
_ALL_TO_ALL = {"all_to_all", "all_to_all_single"}

Recorded = tuple[str, bool, int]
"""(op as the cost model names it, in the backward, buffer bytes)"""


def _bytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def call_buffer(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, int]:
    """(op, bytes) of one call of torch.distributed's ``name``: an all-gather's output, a reduce-scatter's input, an
    all-to-all's input, any other call's first tensor argument (a broadcast, a reduce: priced as an all-reduce)."""
    values = [*args, *kwargs.values()]
    if name in _GATHERS:  # (output, input): the output, a list or one tensor
        return "all_gather", _bytes(values[0]) if values else 0
    if name in _SCATTERS or name in _ALL_TO_ALL:  # (output, input): the input
        op = "reduce_scatter" if name in _SCATTERS else "all_to_all"
        return op, _bytes(values[1]) if len(values) > 1 else 0
    first = next((v for v in values if isinstance(v, (Tensor, list, tuple))), None)
    return "all_reduce", _bytes(first)


def record(forward: Callable[[], Tensor]) -> list[Recorded]:
    """The collectives ``forward()`` and the backward of its output (seeded with ones) call, in order."""
    calls: list[Recorded] = []
    backward = [False]

    def around(name: str, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        op, nbytes = call_buffer(name, args, kwargs)
        calls.append((op, backward[0], nbytes))
        return call(*args, **kwargs)

    with Intercept(around, COLLECTIVES, key="galva-call-recorder"):
        out = forward()
        out = out[0] if isinstance(out, tuple) else out
        backward[0] = True
        out.backward(torch.ones_like(out))
    return calls


def per_sample(
    small: Sequence[Recorded], large: Sequence[Recorded], b_small: int, b_large: int
) -> tuple[CollectiveCall, ...]:
    """The calls of two recordings at ``b_small`` and ``b_large`` samples, each buffer as bytes per sample and fixed
    bytes. Where the two disagree (another sequence of calls at the other size) every buffer of the larger is taken
    as per-sample bytes: never less than it is at that size."""
    same = len(small) == len(large) and all(a[:2] == b[:2] for a, b in zip(small, large))
    out = []
    for index, (op, backward, nbytes) in enumerate(large):
        if same:
            slope = max(0.0, (nbytes - small[index][2]) / (b_large - b_small))
            fixed = max(0.0, nbytes - slope * b_large)
        else:
            slope, fixed = nbytes / b_large, 0.0
        out.append(CollectiveCall(op=op, backward=backward, bytes_per_sample=slope, bytes_fixed=fixed))
    return tuple(out)
