"""Where a pipeline step's time goes, per rank and per op (``bench_schedules.py --trace``).

:func:`install` wraps, in this process only (a forked benchmark rank), the methods galva-hp's schedule executor calls
for each step of a schedule (``_StageHooks.forward``, the backward brackets, ``pipeline.input_backward``, the p2p
receives and sends of ``PipelineStage``) and the parts of ``train_step`` around the schedule (gradient sync, clipping,
the optimizer), so the runtime's code paths are untouched and cost nothing outside the benchmark. Each op records its
wall and its thread CPU seconds; :func:`summary` folds one rank's events of one step into seconds per kind, and
:func:`replay` re-runs the stages' orders with every op's measured duration and instant messages: the step a
schedule would take if its ops cost what they did and nothing else (p2p latency, waiting) did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import galva_hp.pipeline as pipeline
from galva_hp import GalvaOptimizer
from galva_hp.build import HybridParallelModel
from galva_hp.runtime import _StageHooks


@dataclass(frozen=True)
class Event:
    kind: str  # F, B, I, W, recv, send, wait-sends, grad-sync, clip, optimizer, zero-grad
    chunk: int  # -1 where it has none
    micro_batch: int
    start: float  # perf_counter seconds
    wall: float
    cpu: float  # this thread's CPU seconds


EVENTS: list[Event] = []
_OPEN: dict[tuple[int, int], tuple[float, float]] = {}  # (chunk, k) -> start of a B or W bracket
_LAST_I = [-1, -1]  # the running I's (chunk, micro-batch): input_backward itself does not know them


def _timed(kind: str, fn: Callable[..., Any], where: Callable[..., tuple[int, int]]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        chunk, k = where(*args, **kwargs)
        EVENTS.append(Event(kind, chunk, k, start, time.perf_counter() - start, time.thread_time() - cpu))
        return out

    return wrapper


def install() -> None:
    """Wrap the executor's ops in this process (idempotent)."""
    if getattr(pipeline, "_traced", False):
        return
    pipeline._traced = True  # type: ignore[attr-defined]
    none = lambda *a, **k: (-1, -1)  # noqa: E731
    stage = pipeline.PipelineStage
    # tag 2c + 1: chunk c's input (forward); 2c + 2: the gradient of chunk c's output (backward)
    stage._recv = _timed("recv", stage._recv, lambda self, src, tag, *a: ((tag - 1) // 2, tag % 2))  # type: ignore[method-assign]
    stage._send = _timed("send", stage._send, lambda self, t, dst, tag, *a, **k: ((tag - 1) // 2, tag % 2))  # type: ignore[method-assign]
    stage.wait_sends = _timed("wait-sends", stage.wait_sends, none)  # type: ignore[method-assign]
    _StageHooks.forward = _timed("F", _StageHooks.forward, lambda self, c, r, k: (c, k))  # type: ignore[method-assign]
    pipeline.input_backward = _timed("I", pipeline.input_backward, lambda *a, **k: (_LAST_I[0], _LAST_I[1]))
    before, after = _StageHooks.before_backward, _StageHooks.after_backward
    before_input = _StageHooks.before_input_backward

    def before_backward(self: Any, chunk: int, k: int, final: bool, split: bool) -> None:
        _OPEN[(chunk, k)] = (time.perf_counter(), time.thread_time())
        before(self, chunk, k, final, split)

    def after_backward(self: Any, chunk: int, k: int, final: bool, split: bool) -> None:
        after(self, chunk, k, final, split)
        start, cpu = _OPEN.pop((chunk, k))
        wall = time.perf_counter() - start
        EVENTS.append(Event("W" if split else "B", chunk, k, start, wall, time.thread_time() - cpu))

    def before_input_backward(self: Any, chunk: int, k: int) -> None:
        _LAST_I[:] = [chunk, k]
        before_input(self, chunk, k)

    _StageHooks.before_backward = before_backward  # type: ignore[method-assign]
    _StageHooks.after_backward = after_backward  # type: ignore[method-assign]
    _StageHooks.before_input_backward = before_input_backward  # type: ignore[method-assign]
    HybridParallelModel.finish_gradients = _timed(  # type: ignore[method-assign]
        "grad-sync", HybridParallelModel.finish_gradients, none
    )
    GalvaOptimizer.clip_grad_norm = _timed("clip", GalvaOptimizer.clip_grad_norm, none)  # type: ignore[method-assign]
    GalvaOptimizer.step = _timed("optimizer", GalvaOptimizer.step, none)  # type: ignore[method-assign]
    GalvaOptimizer.zero_grad = _timed("zero-grad", GalvaOptimizer.zero_grad, none)  # type: ignore[method-assign]


def take() -> list[Event]:
    """The events since the last call."""
    out = list(EVENTS)
    EVENTS.clear()
    return out


def summary(events: Sequence[Event], step_start: float, step_wall: float) -> dict[str, float]:
    """Milliseconds per kind of one rank's step: ``<kind>`` wall, ``<kind> cpu``, ``recv wait`` (a receive's wall
    beyond its CPU: the time the rank waited for its peer), ``other`` (the step's wall outside every op)."""
    out: dict[str, float] = {}
    covered = 0.0
    for e in events:
        out[e.kind] = out.get(e.kind, 0.0) + e.wall * 1e3
        out[f"{e.kind} cpu"] = out.get(f"{e.kind} cpu", 0.0) + e.cpu * 1e3
        out[f"{e.kind} n"] = out.get(f"{e.kind} n", 0.0) + 1
        covered += e.wall
    out["recv wait"] = out.get("recv", 0.0) - out.get("recv cpu", 0.0)
    out["other"] = (step_wall - covered) * 1e3
    out["step"] = step_wall * 1e3
    return out


def message_delays(events: Sequence[Sequence[Event]]) -> list[float]:
    """Seconds from each message's send to the end of its receive, where the receiver was already waiting when it
    was sent (the delay a blocked receiver sees); ``events[r]`` is rank ``r``'s events of one step. Messages between
    two ranks with one tag arrive in order, so the n-th receive of a (chunk, direction) matches its n-th send; the
    clock (``perf_counter``, CLOCK_MONOTONIC) is the same in every process of the machine."""
    sends: dict[tuple[int, int], list[Event]] = {}
    recvs: dict[tuple[int, int], list[Event]] = {}
    for rank_events in events:
        for e in rank_events:
            if e.kind in ("send", "recv"):
                (sends if e.kind == "send" else recvs).setdefault((e.chunk, e.micro_batch), []).append(e)
    out = []
    for key, received in recvs.items():
        by_start = sorted(sends.get(key, []), key=lambda e: e.start)
        for send, recv in zip(by_start, sorted(received, key=lambda e: e.start)):
            if recv.start <= send.start:
                out.append(recv.start + recv.wall - send.start)
    return out


def replay(
    orders: Sequence[Sequence[pipeline.Step]], durations: Sequence[dict[tuple[str, int, int], float]], num_chunks: int
) -> float:
    """The step the stages' ``orders`` take when each op lasts its measured duration (``durations[s][(kind, chunk,
    k)]``, seconds) and messages arrive the moment they are sent (blocking receives, non-blocking sends): galva-hp's
    own schedule simulation on the measured durations."""
    from galva_comm.schedules import simulate

    return max(simulate(orders, num_chunks, duration=lambda s, step: durations[s][step]))
