"""Forward and backward time of one module at one batch size and sequence length (warm-up, repetitions, median),
or at several sizes interleaved."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from galva_comm.intercept import COLLECTIVES, Intercept
from galva_profiler.distributed import synchronize
from galva_profiler.timing import Repeats

K = TypeVar("K")


@dataclass(frozen=True)
class PassTimes:
    """Median forward and backward ms of one module call."""

    forward_ms: float
    backward_ms: float


def time_passes(forward: Callable[[], Tensor], repeats: Repeats, device: torch.device | None = None) -> PassTimes:
    """Time ``forward()`` and the backward of its (scalar-reduced) output, each repetition timed on its own.

    The backward is seeded with ones of the output's shape, so its cost is the module's backward alone (no loss).
    """
    return time_interleaved({0: forward}, repeats, device)[0]


def time_interleaved(
    forwards: Mapping[K, Callable[[], Tensor]],
    repeats: Repeats,
    device: torch.device | None = None,
    span_s: float = 0.0,
    lead: int | None = None,
    after_round: Callable[[], object] | None = None,
) -> dict[K, PassTimes]:
    """:func:`time_passes` of several forwards (a layer at each batch size), round robin: every repetition (and
    warm-up) runs each forward once, in turn, and each keeps the median of its own repetitions. The timed rounds go
    on past ``repeats.repetitions`` until they span ``span_s`` seconds of wall time.

    Timed one after another, the points of a fit each caught their own share of a shared machine's drift (a burst of
    outside load, a frequency change) and the slope between them was that drift's as much as the layer's: the same
    quickstart profile's slope read 1.97 and 1.01 ms per sample. Interleaved, a drift longer than one round falls on
    every point alike.

    The span: a shared machine's processors change speed in bursts of seconds
    (:data:`galva_profiler.timing.TIMING_SPAN_S`).

    ``lead``: untimed passes of a forward's own shape before each of its timed ones; None: :func:`shape_lead` (on
    a GPU one, on CPU none).

    ``after_round``: called after every timed round (the model profile samples its reference matmul there, so the
    samples span the same minutes as the passes: :mod:`galva_profiler.reference_speed`).
    """
    device = device or torch.device("cpu")
    for _ in range(repeats.warmup):
        for forward in forwards.values():
            _one_pass(forward, device)
    forwards_ms: dict[K, list[float]] = {key: [] for key in forwards}
    backwards_ms: dict[K, list[float]] = {key: [] for key in forwards}
    start, rounds = time.perf_counter(), 0
    if lead is None:
        lead = shape_lead(device) if len(forwards) > 1 else 0
    while rounds < repeats.repetitions or time.perf_counter() - start < span_s:
        for key, forward in forwards.items():
            for _ in range(lead):
                _one_pass(forward, device)
            forward_ms, backward_ms = _one_pass(forward, device)
            forwards_ms[key].append(forward_ms)
            backwards_ms[key].append(backward_ms)
        if after_round is not None:
            after_round()
        rounds += 1
    median = statistics.median
    return {key: PassTimes(median(forwards_ms[key]), median(backwards_ms[key])) for key in forwards}


def shape_lead(device: torch.device) -> int:
    """Untimed passes of a shape before each timed one where several shapes are timed in turn.

    A pass after one of another shape costs the host more: on an NVIDIA H100 a small Llama layer's forward read
    3.45 ms after another batch size and 2.05 ms after its own (``benchmarks/costmodel/gpu_layer_timing.py``), at
    every size alike. A GPU step runs its layers at one shape, so the device's times take the second. On CPU the
    same change reads 3.3 against 1.2 ms, but galva-hp's layers inside a step pay most of it all the same (the
    step's forward CPU time sits near the round robin's), so the CPU keeps none."""
    return 0 if device.type == "cpu" else 1


@contextmanager
def on_device(device: torch.device, *modules: torch.nn.Module) -> Iterator[None]:
    """``modules`` moved to ``device`` (in place: a weight two of them share stays one tensor) and back to CPU after."""
    for module in modules:
        module.to(device)
    try:
        yield
    finally:
        for module in modules:
            module.to("cpu")


def pass_clock(device: torch.device) -> Callable[[], float]:
    """The clock a layer's passes are timed by: on CPU with one intra-op thread the calling thread's CPU time (the
    forward and autograd's backward both run on it, so it is the quiet wall time, and outside load adds little to
    it: a wall-clock profile of tiny-llama read a layer's forward intercept 2.0-3.2 ms quiet and 8.2-10.6 ms at
    load 5-12), else wall time (a device's kernels, or intra-op threads the calling thread's clock does not see).
    The job's own sharing of the processors is priced once, by the hardware profile's ``compute_slowdown``."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _one_pass(forward: Callable[[], Tensor], device: torch.device) -> tuple[float, float]:
    """(forward ms, backward ms) of one call, by :func:`pass_clock`."""
    clock = pass_clock(device)
    synchronize(device)
    start = clock()
    out = forward()
    synchronize(device)
    middle = clock()
    out.backward(torch.ones_like(out))
    synchronize(device)
    end = clock()
    return (middle - start) * 1e3, (end - middle) * 1e3


def layer_forward(
    module: torch.nn.Module,
    batch: int,
    seq: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> Callable[[], Tensor]:
    """A forward of a transformer layer on a fresh ``[batch, seq, hidden]`` input that requires grad (as in a model),
    on ``device`` (the module's own; CPU by default)."""
    x = torch.randn(batch, seq, hidden, dtype=dtype, device=device, requires_grad=True)

    def run() -> Tensor:
        module.zero_grad(set_to_none=True)
        x.grad = None
        return module(x)

    return run


def weight_grad_share(
    module: torch.nn.Module,
    batch: int,
    seq: int,
    hidden: int,
    dtype: torch.dtype,
    repeats: Repeats,
    device: torch.device | None = None,
) -> float:
    """The share of a layer's backward that is weight gradients: what zb-h1 defers into the bubble.

    Each repetition times the whole backward and, on a fresh forward, the input-gradient backward alone
    (``torch.autograd.grad`` with respect to the input); the share is ``1 - min(input) / min(whole)``, in [0, 1].
    The two alternate, and each side keeps its fastest repetition: outside load only ever adds time, so the
    minimum is the least disturbed run of each (medians of a loaded machine compared one burst against another and
    could invert the two, clamping the share to 0).
    """
    x = torch.randn(batch, seq, hidden, dtype=dtype, device=device, requires_grad=True)
    whole, inputs = _alternating_backwards(
        module, x, (lambda out, seed: out.backward(seed), lambda out, seed: torch.autograd.grad(out, x, seed)),
        repeats, device or torch.device("cpu"), time.perf_counter,
    )  # fmt: skip
    return min(1.0, max(0.0, 1.0 - min(inputs) / min(whole)))


def split_backward_overhead_share(
    module: torch.nn.Module,
    batch: int,
    seq: int,
    hidden: int,
    dtype: torch.dtype,
    repeats: Repeats,
    device: torch.device | None = None,
) -> float:
    """What zb-h1's split backward costs beyond one backward, as a share of that backward.

    Each repetition times, on fresh forwards, the whole backward (one ``torch.autograd.backward``) and the split
    as galva-hp's pipeline runs it (:func:`galva_hp.pipeline.input_backward`, then
    :func:`galva_hp.pipeline.weight_backward`: the graph analysis and one autograd call per parameter group); the
    share is the median of the paired ratios less one (split over whole, repetition by repetition: pairs cancel slow
    drifts), at least 0, over at least :data:`MIN_SPLIT_REPETITIONS` pairs (5 read 1.8 to 3.7 ms a layer call in
    one hour). On CPU both are the calling thread's CPU time (autograd runs CPU work on it, and outside load adds
    little to it), on a device wall time. The caller prices it on the layer's backward as the profile times it, so
    the overhead and the layer's times share one clock (in milliseconds of CPU time the overhead weighed half its
    share beside wall times a loaded machine had doubled).

    On CPU each backward starts from cold caches, and :data:`~galva_profiler.layer_step.EVICT_MIB` are written
    between ``I`` and ``W`` (untimed): the schedule runs ``W`` after other micro-batches' passes, so what ``I`` left
    for it is out of cache. A GPT-2 layer (hidden 256, batch 2, one thread, 30 pairs): 2.6-2.8 ms beyond the whole
    backward back to back, 4.1-4.8 ms with 32 MiB written between ``I`` and ``W``; this function, four runs in a
    row, shares 0.167-0.184 (3.1-3.4 ms); inside zb-h1 steps on 2 ranks, chunks of 4 layers, 5.2 ms a layer call while
    ``input_backward`` walked the graph twice (once since; the profile then read 2.3-3.1 ms).
    """
    from galva_hp.pipeline import input_backward, weight_backward  # the runtime's own split (model extra)
    from galva_profiler.layer_step import cache_evictor

    device = device or torch.device("cpu")
    clock = time.thread_time if device.type == "cpu" else time.perf_counter
    evict = cache_evictor(device)

    def cold() -> float:
        """Seconds spent evicting (nothing on a device)."""
        start = clock()
        evict()
        return clock() - start

    def whole(out: torch.Tensor, seed: torch.Tensor) -> float:
        paused = cold()
        torch.autograd.backward([out], [seed])
        return paused

    def split(out: torch.Tensor, seed: torch.Tensor) -> float:
        paused = cold()
        pending = input_backward([out], [seed], x)
        paused += cold()
        weight_backward(pending)
        return paused

    x = torch.randn(batch, seq, hidden, dtype=dtype, device=device, requires_grad=True)
    times = _alternating_backwards(
        module, x, (whole, split),
        Repeats(repeats.warmup, max(repeats.repetitions, MIN_SPLIT_REPETITIONS)), device, clock,
    )  # fmt: skip
    return max(0.0, statistics.median(s / w - 1.0 for s, w in zip(times[1], times[0]) if w > 0.0))


MIN_SPLIT_REPETITIONS = 15
"""Pairs of backwards, at least, behind the split backward's overhead."""


def _alternating_backwards(
    module: torch.nn.Module,
    x: torch.Tensor,
    backwards: tuple[Callable[[torch.Tensor, torch.Tensor], Any], ...],
    repeats: Repeats,
    device: torch.device,
    clock: Callable[[], float],
) -> list[list[float]]:
    """Seconds of each of ``backwards(out, seed)`` per timed repetition, each on a fresh forward of ``x``, the
    variants alternating repetition by repetition (drifts of a shared machine's load hit them alike). A backward
    that returns a float spent that many of the clock's seconds on untimed work, which is left out."""
    times: list[list[float]] = [[] for _ in backwards]
    for index in range(repeats.warmup + repeats.repetitions):
        for k, backward in enumerate(backwards):
            module.zero_grad(set_to_none=True)
            x.grad = None
            out = module(x)
            seed = torch.ones_like(out)
            synchronize(device)
            start = clock()
            paused = backward(out, seed)
            synchronize(device)
            if index >= repeats.warmup:
                times[k].append(clock() - start - (paused if isinstance(paused, float) else 0.0))
    return times


FORM_SAMPLES = 2
"""The plain module's batch when a parallel form's own work is timed against it (the form's: the same work a rank)."""
FASTEST_OF = (1, 4)
"""Warm-up and timed rounds of :func:`fastest_passes`."""


def fastest_passes(runs: Sequence[Callable[[], tuple[float, float]]]) -> list[tuple[float, float]]:
    """Each of ``runs`` (one pass, returning its forward and backward seconds: :func:`cpu_pass`) in turn, round by
    round (a drift of the machine's speed falls on all alike), after :data:`FASTEST_OF` warm-up rounds; the fastest
    forward and backward of each (outside load only adds time)."""
    warmup, repeats = FASTEST_OF
    best = [(float("inf"), float("inf")) for _ in runs]
    for index in range(warmup + repeats):
        for k, run in enumerate(runs):
            forward, backward = run()
            if index >= warmup:
                best[k] = (min(best[k][0], forward), min(best[k][1], backward))
    return best


def excess_ms(times: tuple[float, float], baseline: tuple[float, float]) -> tuple[float, float]:
    """(forward, backward) ms ``times`` take beyond ``baseline`` (seconds each), at least 0."""
    return max(0.0, (times[0] - baseline[0]) * 1e3), max(0.0, (times[1] - baseline[1]) * 1e3)


def cpu_passes(module: torch.nn.Module, batch: int, seq: int, hidden: int, dtype: torch.dtype) -> tuple[float, float]:
    """:func:`cpu_pass` of ``module`` on a fresh ``[batch, seq, hidden]`` input."""
    x = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True)
    return cpu_pass(lambda: module(x))


def cpu_pass(forward: Callable[[], Any]) -> tuple[float, float]:
    """Main-thread CPU seconds of ``forward()`` and of the backward of its output (its first element if a tuple;
    seeded with ones), less the CPU spent inside torch.distributed's collectives (:class:`CollectiveCpu`): a call's
    own CPU is in the hardware profile's time of that call, which the cost model adds beside."""
    with CollectiveCpu() as calls:
        start = time.thread_time()
        out = forward()
        out = out[0] if isinstance(out, tuple) else out
        middle = time.thread_time()
        forward_calls = calls.seconds
        out.backward(torch.ones_like(out))
        end = time.thread_time()
    return middle - start - forward_calls, end - middle - (calls.seconds - forward_calls)


class CollectiveCpu:
    """Inside the block, the calling thread's CPU seconds spent inside torch.distributed's collectives
    (``seconds``), through :class:`galva_comm.intercept.Intercept` (callers that look them up on
    ``torch.distributed`` per call, as galva-hp's mappings and FSDP2 do). Measured on 2 gloo ranks, an all-gather's
    call takes 0.12 ms of its caller's CPU, a reduce-scatter's 0.16, an all-reduce's 0.08."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._intercept = Intercept(self._metered, COLLECTIVES, key="galva-collective-cpu")

    def __enter__(self) -> CollectiveCpu:
        self._intercept.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self._intercept.remove()

    def _metered(self, name: str, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._depth += 1
        start = time.thread_time()
        try:
            return call(*args, **kwargs)
        finally:
            self._depth -= 1
            if self._depth == 0:  # one collective calling another is counted once
                self.seconds += time.thread_time() - start
