"""What the vocabulary layers' parallel forms cost beyond the plain modules: per-call CPU and the collectives they call.

Timed on the forked ranks that measure the forms' memory (:func:`galva_profiler.vocab.vocab_memory`), per degree
``k`` and per module (the embedding; the final norm, head and loss), as the layers' forms are
(:mod:`galva_profiler.activation_memory`, :mod:`galva_profiler.sharded_overhead`):

* ``tp``: galva-hp's vocabulary-parallel form (the parallelizer's, at the profile's Megatron-SP setting) on
  ``2k`` samples against the plain module on 2, the same work per rank (each rank scores a ``1/k`` slice of the
  vocabulary for all its samples);
* ``zero3``: the plain module as a ZeRO-3 unit (FSDP2, galva-hp's ``wrap``) over the ``k`` ranks against the plain
  module, both on 2 samples, and galva-hp's AdamW on the unit's shards against the same on plain tensors.

Each in the main thread's CPU time less the CPU spent inside torch.distributed's calls (their time is the hardware
profile's, per call), alternating with the plain module repetition by repetition, the fastest of each kept; then the
form's collectives are recorded at two batch sizes (:mod:`galva_profiler.collective_calls`), which galva-search
prices call by call. A weight tied between the embedding and the head is timed untied here (a copy each).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn

from galva_profiler.collective_calls import per_sample, record
from galva_profiler.layer_timing import cpu_pass
from galva_schema import VocabForm, VocabPart

SAMPLES = 2  # the plain module's batch (as the layers' forms: activation_memory.OVERHEAD_SAMPLES)
REPEATS = (1, 4)  # warm-up, timed repetitions (alternating, the fastest kept)

PARTS: tuple[Literal["embedding", "head"], ...] = ("embedding", "head")
Pass = Callable[[int], Any]
"""A module's forward at a batch size: its output (or ``(loss, count)``), ready for a backward seeded with ones."""


def _part(plain: Pass, form: Pass, form_batch: int, step_ms: float = 0.0) -> VocabPart:
    """``form`` at ``form_batch`` samples against ``plain`` at :data:`SAMPLES`, and ``form``'s calls."""
    warmup, repeats = REPEATS
    best = [[float("inf")] * 2, [float("inf")] * 2]  # [plain, form] x [forward, backward]
    for index in range(warmup + repeats):
        for k, (run, batch) in enumerate(((plain, SAMPLES), (form, form_batch))):
            times = cpu_pass(partial(run, batch))
            if index >= warmup:
                best[k] = [min(a, t) for a, t in zip(best[k], times)]
    small, large = record(lambda: form(form_batch)), record(lambda: form(2 * form_batch))
    calls = per_sample(small, large, form_batch, 2 * form_batch)
    forward, backward = (max(0.0, (f - p) * 1e3) for p, f in zip(best[0], best[1]))
    return VocabPart(overhead_ms=(forward, backward, step_ms), calls=calls)


def _zero_grad(*modules: nn.Module) -> None:
    for module in modules:
        module.zero_grad(set_to_none=True)


def measure_forms(
    plain_embedding: nn.Module,
    plain_head: nn.Module,
    embedding: nn.Module,
    head: nn.Module,
    embed_input: Callable[[int], Tensor],
    head_input: Callable[[int, int], tuple[Tensor, Tensor]],
    head_seq: tuple[int, int],
    group: Any,
    dtype: torch.dtype,
) -> dict[str, VocabForm]:
    """``{"tp": ..., "zero3": ...}`` on this rank of ``group`` (every rank calls it). ``embedding``, ``head``: this
    rank's vocabulary-parallel forms; ``embed_input(b)``: the embedding's input; ``head_input(b, seq)``: the head's
    hidden input and labels at sequence ``seq``; ``head_seq``: (the plain head's sequence, the form's)."""
    from galva_hp.data_parallel import wrap
    from galva_hp.precision import PrecisionPolicy
    from galva_profiler.sharded_overhead import step_overhead_ms
    from galva_schema import DataParallelType

    degree = group.size()
    plain_seq, form_seq = head_seq

    def embed(module: nn.Module) -> Pass:
        return lambda b: module(embed_input(b))

    def score(module: nn.Module, seq: int) -> Pass:
        return lambda b: module(*head_input(b, seq))[0]

    tp = VocabForm(
        embedding=_part(embed(plain_embedding), embed(embedding), SAMPLES * degree),
        head=_part(score(plain_head, plain_seq), score(head, form_seq), SAMPLES * degree),
    )
    _zero_grad(plain_embedding, plain_head, embedding, head)
    policy = PrecisionPolicy() if dtype == torch.float32 else PrecisionPolicy(dtype, torch.float32)
    units = {
        name: wrap(name, copy.deepcopy(module).float(), DataParallelType.ZERO3, group, policy)
        for name, module in (("embedding", plain_embedding), ("head", plain_head))
    }
    parts = {}
    for name, plain_pass, unit_pass in (
        ("embedding", embed(plain_embedding), embed(units["embedding"].module)),
        ("head", score(plain_head, plain_seq), score(units["head"].module, plain_seq)),
    ):
        unit = units[name]
        unit.before_backward(True)
        part = _part(plain_pass, unit_pass, SAMPLES)
        parts[name] = part.model_copy(update={"overhead_ms": (*part.overhead_ms[:2], step_overhead_ms(unit))})
    return {"tp": tp, "zero3": VocabForm(embedding=parts["embedding"], head=parts["head"])}


def slowest(forms: list[dict[str, VocabForm]]) -> dict[str, VocabForm]:
    """The ranks' measurements as one: the group moves at its slowest rank's pace, so each overhead is the largest
    over the ranks; the calls are rank 0's (every rank makes the same)."""
    out = {}
    for name, first in forms[0].items():
        parts = {}
        for part_name in PARTS:
            ranks = [f[name].part(part_name) for f in forms]
            overhead = tuple(max(values) for values in zip(*(p.overhead_ms for p in ranks)))
            parts[part_name] = first.part(part_name).model_copy(update={"overhead_ms": overhead})
        out[name] = VocabForm(**parts)
    return out
