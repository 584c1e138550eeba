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

from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn

from galva_profiler.collective_calls import per_sample, record
from galva_profiler.layer_timing import FORM_SAMPLES, cpu_pass, excess_ms, fastest_passes
from galva_schema import VocabForm, VocabPart

PARTS: tuple[Literal["embedding", "head"], ...] = ("embedding", "head")
Pass = Callable[[int], Any]
"""A module's forward at a batch size: its output (or ``(loss, count)``), ready for a backward seeded with ones."""


def _part(plain: Pass, form: Pass, form_batch: int) -> VocabPart:
    """``form`` at ``form_batch`` samples against ``plain`` at :data:`~galva_profiler.layer_timing.FORM_SAMPLES`
    (no step), and ``form``'s calls."""
    runs = [partial(cpu_pass, partial(plain, FORM_SAMPLES)), partial(cpu_pass, partial(form, form_batch))]
    base, own = fastest_passes(runs)
    small, large = record(partial(form, form_batch)), record(partial(form, 2 * form_batch))
    calls = per_sample(small, large, form_batch, 2 * form_batch)
    return VocabPart(overhead_ms=(*excess_ms(own, base), 0.0), calls=calls)


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
    from galva_profiler.sharded_overhead import sharded_unit, step_overhead_ms

    degree = group.size()
    plain_seq, form_seq = head_seq

    def embed(module: nn.Module) -> Pass:
        return lambda b: module(embed_input(b))

    def score(module: nn.Module, seq: int) -> Pass:
        return lambda b: module(*head_input(b, seq))[0]

    tp = VocabForm(
        embedding=_part(embed(plain_embedding), embed(embedding), FORM_SAMPLES * degree),
        head=_part(score(plain_head, plain_seq), score(head, form_seq), FORM_SAMPLES * degree),
    )
    for module in (plain_embedding, plain_head, embedding, head):
        module.zero_grad(set_to_none=True)
    parts = {}
    modules = (("embedding", plain_embedding, embed), ("head", plain_head, partial(score, seq=plain_seq)))
    for name, plain, as_pass in modules:
        unit = sharded_unit(name, plain, "zero3", group, dtype)
        unit.before_backward(True)
        part = _part(as_pass(plain), as_pass(unit.module), FORM_SAMPLES)
        parts[name] = part.model_copy(update={"overhead_ms": (*part.overhead_ms[:2], step_overhead_ms(unit))})
    return {"tp": tp, "zero3": VocabForm(**parts)}


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
