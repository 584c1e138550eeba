"""The order of pipeline steps on every stage: GPipe, 1F1B, interleaved 1F1B and zero-bubble ZB-H1.

A schedule is, per stage, a list of :class:`Step` ``(kind, chunk, micro_batch)``: ``F`` forward, ``B`` full backward,
``I`` input-gradient backward (what the previous chunk waits for), ``W`` weight-gradient backward (what nobody waits
for). ``chunk`` is the global model chunk (``Strategy.chunk_layers``); stage ``s`` holds chunks ``s, s + pp, ...``.

Every order is checked by :func:`simulate`: stages run their lists in order, a receive blocks until the matching send
has happened, sends never block (the runtime's p2p sends are asynchronous). A schedule is deadlock-free when the
simulation finishes; the tests simulate every schedule over a range of pp, v and micro-batch counts. The orders live
here, beside galva-hp's other shared rules, because galva-search prices a schedule on shared processors by running
the very steps galva-hp executes (``galva_search.shared_schedule``).

- GPipe: every forward, then every backward.
- 1F1B (PipeDream-flush): ``pp - s - 1`` warm-up forwards, then one forward / one backward, then the rest.
- interleaved 1F1B (Megatron-LM's order): forwards walk the stage's chunks in groups of ``pp`` micro-batches, backwards
  walk them in reverse; ``2 (pp - s - 1) + (v - 1) pp`` warm-up forwards (all of them when ``n == pp``).
- ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with every backward split in I and W; only I is
  on the critical path between stages, and stage ``s`` keeps ``s`` W passes back for the cool-down. Every stage then
  holds at most ``pp`` micro-batches' activations (1F1B's stage 0 peak), and with F = I = W the simulated step is
  ``3 n + pp - 1`` against 1F1B's ``3 n + 3 (pp - 1)``: a third of the bubble, as the paper's ZB-H1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from galva_schema import PipelineSchedule

__all__ = ["Step", "schedule_order", "simulate"]


class Step(NamedTuple):
    kind: str  # "F", "B", "I" or "W"
    chunk: int  # global model chunk
    micro_batch: int


def schedule_order(
    schedule: PipelineSchedule, stage: int, num_stages: int, num_micro_batches: int, virtual_stages: int = 1
) -> list[Step]:
    """The steps of ``stage``, in order."""
    pp, n, v = num_stages, num_micro_batches, virtual_stages
    if schedule is PipelineSchedule.INTERLEAVED_1F1B and v > 1:
        return _interleaved(stage, pp, n, v)
    if v != 1:
        raise ValueError(f"{schedule.value} runs one model chunk per stage, not {v}")
    if pp == 1:
        return [step for k in range(n) for step in (Step("F", 0, k), Step("B", 0, k))]
    if schedule is PipelineSchedule.GPIPE:
        return [Step("F", stage, k) for k in range(n)] + [Step("B", stage, k) for k in range(n)]
    if schedule is PipelineSchedule.ZB_H1:
        return _zb_h1(stage, pp, n)
    warmup = min(pp - stage - 1, n)
    order = [Step("F", stage, k) for k in range(warmup)]
    for i in range(n - warmup):
        order += [Step("F", stage, warmup + i), Step("B", stage, i)]
    order += [Step("B", stage, k) for k in range(n - warmup, n)]
    return order


def _interleaved(stage: int, pp: int, n: int, v: int) -> list[Step]:
    if n % pp:
        raise ValueError(f"interleaved 1F1B needs a multiple of pp {pp} micro-batches, got {n}")
    total = n * v

    def chunk_and_batch(i: int, forward: bool) -> tuple[int, int]:
        local = (i // pp) % v
        if not forward:
            local = v - 1 - local
        return stage + local * pp, (i // (pp * v)) * pp + i % pp

    warmup = total if n == pp else min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    order = [Step("F", *chunk_and_batch(i, True)) for i in range(warmup)]
    for i in range(total - warmup):
        order += [Step("F", *chunk_and_batch(warmup + i, True)), Step("B", *chunk_and_batch(i, False))]
    order += [Step("B", *chunk_and_batch(i, False)) for i in range(total - warmup, total)]
    return order


def _zb_h1(stage: int, pp: int, n: int) -> list[Step]:
    warmup = min(pp - stage - 1, n)
    deferred = stage  # W passes kept back: the later the stage, the longer it waits for the last gradients
    order = [Step("F", stage, k) for k in range(warmup)]
    pending: list[int] = []

    def backward(k: int) -> None:
        if deferred == 0:  # stage 0: nothing waits for its input gradient, the split would gain nothing
            order.append(Step("B", stage, k))
            return
        order.append(Step("I", stage, k))
        pending.append(k)
        if len(pending) > deferred:
            order.append(Step("W", stage, pending.pop(0)))

    for i in range(n - warmup):
        order.append(Step("F", stage, warmup + i))
        backward(i)
    for k in range(n - warmup, n):
        backward(k)
    order += [Step("W", stage, k) for k in pending]
    return order


def simulate(
    orders: Sequence[Sequence[Step]],
    num_chunks: int,
    cost: dict[str, float] | None = None,
    duration: Callable[[int, Step], float] | None = None,
) -> list[float]:
    """Run the stages' orders with blocking receives and non-blocking sends; return each stage's finishing time.

    ``cost`` gives the duration of each kind of step (F 1, B 2, I 1, W 1 by default); ``duration(stage, step)``, when
    given, each step's own (a measured trace replayed). Raises ``RuntimeError`` on a deadlock (no stage can take its
    next step) and ``ValueError`` when a step is missing or repeated.
    """
    cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, **(cost or {})}
    done: dict[tuple[str, int, int], float] = {}  # (kind, chunk, micro-batch) -> finishing time
    clock = [0.0] * len(orders)
    position = [0] * len(orders)
    last = num_chunks - 1

    def ready(step: Step) -> float | None:
        """When the step's input is there (None: not yet produced)."""
        kind, chunk, k = step
        if kind == "F":
            return 0.0 if chunk == 0 else done.get(("F", chunk - 1, k))
        if kind == "W":
            return done.get(("I", chunk, k))
        if chunk == last:
            return done.get(("F", chunk, k))
        upstream = done.get(("B", chunk + 1, k))
        return upstream if upstream is not None else done.get(("I", chunk + 1, k))

    while any(p < len(o) for p, o in zip(position, orders)):
        progressed = False
        for s, order in enumerate(orders):
            while position[s] < len(order):
                step = order[position[s]]
                at = ready(step)
                if at is None:
                    break
                key = (step.kind, step.chunk, step.micro_batch)
                if key in done:
                    raise ValueError(f"stage {s} repeats {step}")
                clock[s] = max(clock[s], at) + (duration(s, step) if duration else cost[step.kind])
                done[key] = clock[s]
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: order[position[s]] for s, order in enumerate(orders) if position[s] < len(order)}
            raise RuntimeError(f"deadlock: stages wait on {stuck}")
    return clock
