"""What one collective call costs inside a busy step, beyond the idle curve: the profile's ``call_extra``.

The curves (:mod:`galva_profiler.collectives`) time each call from a barrier, every rank idle and arriving together.
In a training step a call follows a stretch of compute on every rank: the ranks arrive at different times (each
rank's compute jitters; on CPU the ranks share cores with the backend's own threads) and a waiting rank must be
woken, so each call costs the spread of the arrival and the wake-up besides its idle time. Measured as the job meets
it: every rank alternates a compute segment (passes of a small transformer layer, :func:`_layer_pass`, repeated for
about :data:`SEGMENT_MS` on one rank alone) and one call of a latency-bound (4 KiB) message, :data:`CALLS` times,
against the same segments without the calls, from a barrier to the last rank's end
(:func:`galva_profiler.timing.together_ms`). The rounds' per-call differences, in :data:`BLOCKS` blocks, each block's
trimmed mean and their median (:func:`blocked_mean`), less the curve's own 4 KiB time (a trimmed mean:
:func:`galva_profiler.collectives.trimmed_mean`) is the extra, at least 0. On CPU
gloo ranks it is a millisecond or more a call; with a device per rank (NCCL) it is small, measured the same way.

The segment is a layer's pass, not one matmul in a loop, because the extra is the ranks' arrival spread and that
spread is the compute's own jitter: a layer's dozen small operators, each allocating its output, jitter as a step's
layers do, where a loop of one matmul keeps the ranks in step. Side by side on the 2-core box (4 tests of each,
alternating, 2026-11-28): 2 ranks' busy all-reduce, all-gather and reduce-scatter read 0.7 ms a call more with the
layer (2.1 -> 2.8, 1.6 -> 2.3, 2.4 -> 3.1; all-to-all 1.3 -> 1.5), where 2-rank steps priced on the matmul's extra
read 12-27% under for their collective-heavy plans (their calls inside the step 0.6-0.9 ms above the idle curve on
average); on 4 ranks over groups of 2 the two read alike (all-reduce 3.3 -> 2.8, all-gather 2.3 -> 2.2, all-to-all
1.8 -> 2.3).

Every collective of a group size is timed in one round robin (:func:`busy_calls_ms`): each round runs the plain loop
and one loop per collective in a shuffled order, and each collective's difference is taken against its own round's
plain loop. Timed one collective after another, a shared box's minute-to-minute drift fell on one collective's rounds:
one 4-rank profile priced a reduce-scatter over groups of 2 at 4.3 ms a call and an all-gather at 2.9 against 3.2 for
an all-reduce, where the same calls inside a Megatron-SP step took 2.4 and 1.8 against 3.1 (its step over-predicted
by 19-37% in every round of three quiet sets).

A pipeline's send meets the same: stage ``s`` computes, then sends to stage ``s + 1``, which has been waiting in its
receive and computes next. :func:`busy_send_ms` times that hand-over as a relay between the middle stages of every
pipeline (the pair :func:`galva_profiler.collectives.time_p2p` times), a latency-bound message passed back and forth
with a compute segment before each send, against the same segments on one side without the hand-over; the extra
beyond the idle send (the curve's 4 KiB p2p time) is the profile's ``call_extra`` of ``"p2p"`` for that degree.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from galva_comm.groups import ProcessGroupCache
from galva_comm.layout import Group
from galva_profiler.collectives import Collective, _elements, _operation, group_of, middle_stages, trimmed_mean
from galva_profiler.concurrency import _loop
from galva_profiler.distributed import World
from galva_profiler.timing import Repeats, together_ms

SEGMENT_MS = 2.0
"""The compute between two calls, on one rank alone (a small layer's forward or backward on CPU)."""
CALLS = 8
"""Calls per timed loop."""
MESSAGE_BYTES = 4096  # latency-bound: what the curve's size terms add is theirs, not this term's
BLOCKS = 3
"""Blocks of the test's rounds; the extra is the median of their trimmed means. Seven rounds span about 2 s on 4 CPU
ranks, and a slow burst of the box can fill them: one 2-rank profile in about twelve read the busy all-reduce's
extra at 4.78 ms where the others read 0-1.8 (its 2-rank tp2 step priced at 147 ms against 72 measured), one 4-rank
profile 6.3 ms against 0.85 and 3.27 (2026-11-28; within one quiet test, 7-round blocks agree within 0.3 ms)."""
LAYER_TOKENS = 64
"""Tokens of the segment's layer pass (2 sequences of 32): small, so that the loop's length is close to
:data:`SEGMENT_MS` on CPU and GPU alike."""
LAYER_HIDDEN = 128
LAYER_HEADS = 4
LAYER_FFN = 344  # a llama-like MLP, about 2.7 x the hidden size


def busy_calls_ms(
    kinds: Sequence[Collective],
    groups: list[Group],
    world: World,
    cache: ProcessGroupCache,
    repeats: Repeats,
    rounds: int,
    segment_ms: float = SEGMENT_MS,
) -> dict[Collective, float]:
    """ms one call of each of ``kinds`` (:data:`MESSAGE_BYTES` per rank) costs between compute segments, all
    ``groups`` at once: over :data:`BLOCKS` blocks of at least ``rounds`` rounds, the median of the blocks' trimmed
    means of (loop with calls - the round's loop without) / :data:`CALLS` (:func:`blocked_mean`), segments of
    ``segment_ms``, every kind in each round in a shuffled order (the same on every rank); the same on every rank."""
    group = group_of(groups, world.rank)
    n = len(group)
    segment = _segment(world, segment_ms)
    loops = [_steps(segment, None)] + [
        _steps(segment, _operation(kind, _elements(MESSAGE_BYTES, n), cache.get(group), n, world.device))
        for kind in kinds
    ]
    per_block = max(repeats.repetitions, rounds)
    per_call: list[list[float]] = [[] for _ in kinds]
    for index in range(repeats.warmup + BLOCKS * per_block):
        order = list(range(len(loops)))
        random.Random(index).shuffle(order)  # seeded by the round: the same order on every rank
        ms = [0.0] * len(loops)
        for k in order:
            ms[k] = together_ms(loops[k], world)
        if index >= repeats.warmup:
            for k in range(len(kinds)):
                per_call[k].append((ms[k + 1] - ms[0]) / CALLS)
    return {kind: blocked_mean(values, per_block) for kind, values in zip(kinds, per_call)}


def blocked_mean(values: Sequence[float], per_block: int) -> float:
    """The median of the trimmed means of consecutive blocks of ``per_block`` values (:data:`BLOCKS` of them): a slow
    burst of the machine that fills a block moves that block's mean only."""
    blocks = [values[i : i + per_block] for i in range(0, len(values), per_block)]
    return statistics.median(trimmed_mean(block) for block in blocks if block)


def busy_send_ms(
    pipelines: list[Group], world: World, repeats: Repeats, rounds: int, segment_ms: float = SEGMENT_MS
) -> float:
    """ms one latency-bound send between the middle stages of every pipeline costs when its receiver was waiting
    and each side computes a segment of ``segment_ms`` before it sends (:func:`_per_call` of the relay against the
    same segments on one side); the same on every rank."""
    first, second = middle_stages(pipelines, world.rank)
    token = torch.zeros(MESSAGE_BYTES // 4, device=world.device)
    segment = _segment(world, segment_ms)

    def relay() -> None:  # hop i: the holder computes, then hands the token to the other, waiting in its receive
        if world.rank not in (first, second):
            return
        other = second if world.rank == first else first
        for hop in range(CALLS):
            holder = first if hop % 2 == 0 else second
            if world.rank == holder:
                segment()
                dist.send(token, other)
            else:
                dist.recv(token, other)

    def alone() -> None:  # the same processors' load: one computing rank per pipeline, the segments back to back
        if world.rank == first:
            for _ in range(CALLS):
                segment()

    return _per_call(relay, alone, world, repeats, rounds)


def _segment(world: World, segment_ms: float) -> Callable[[], None]:
    """Passes of :func:`_layer_pass` for about ``segment_ms`` on one rank alone (the compute between two calls)."""
    return _loop(_layer_pass(world.device), world, segment_ms)


def _layer_pass(device: torch.device) -> Callable[[], torch.Tensor]:
    """The forward of a small pre-norm transformer layer (causal attention, gated MLP) on :data:`LAYER_TOKENS`
    tokens: the operators a step computes between two calls, each allocating its output."""
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * shape[0] ** -0.5).to(device)

    hidden, heads, sequences = LAYER_HIDDEN, LAYER_HEADS, 2
    x = weight(LAYER_TOKENS, hidden)
    qkv, out = weight(hidden, 3 * hidden), weight(hidden, hidden)
    gate_up, down = weight(hidden, 2 * LAYER_FFN), weight(LAYER_FFN, hidden)

    def split_heads(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(sequences, LAYER_TOKENS // sequences, heads, hidden // heads).transpose(1, 2)

    def run() -> torch.Tensor:
        q, k, v = (split_heads(t) for t in (F.rms_norm(x, (hidden,)) @ qkv).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        h = x + attended @ out
        gate, up = (F.rms_norm(h, (hidden,)) @ gate_up).chunk(2, dim=-1)
        return h + (F.silu(gate) * up) @ down

    return run


def _per_call(
    busy: Callable[[], None], plain: Callable[[], None], world: World, repeats: Repeats, rounds: int
) -> float:
    """Over :data:`BLOCKS` blocks of at least ``rounds`` alternating rounds, the median of the blocks' trimmed means
    of (``busy`` - ``plain``) / :data:`CALLS`, each timed on every rank at once."""
    per_block = max(repeats.repetitions, rounds)
    per_call = []
    for index in range(repeats.warmup + BLOCKS * per_block):
        with_calls, without = together_ms(busy, world), together_ms(plain, world)
        if index >= repeats.warmup:
            per_call.append((with_calls - without) / CALLS)
    return blocked_mean(per_call, per_block)


def _steps(segment: Callable[[], None], call: Callable[[], None] | None) -> Callable[[], None]:
    def run() -> None:
        for _ in range(CALLS):
            segment()
            if call is not None:
                call()

    return run
