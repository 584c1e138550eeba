"""Gradient reduction runs when the cost model says it does: overlapped with the iteration's last backward.

A torch profiler trace of one ``forward_backward`` gives every collective launched on this rank and, through a full
backward hook on the stage's first layer, a marker each time that layer's backward finishes (once per micro-batch).
With ``n`` micro-batches:

- no gradient reduction (ddp all-reduce, zero2 reduce-scatter) is launched before the marker of micro-batch
  ``n - 2``'s backward: earlier micro-batches only accumulate;
- the first one is launched before the marker of the last micro-batch: the stage's later layers are reduced while
  its first layer is still in backward.

The ddp plans reduce one layer per bucket here (``bucket_cap_bytes=0``, as layers of 25 MiB and more do); under the
default cap this tiny model's layers share one all-reduce, launched in the last backward as well.

With Megatron-SP layers (vocabulary replicated), the gradients of the tp-replicated norms and biases are summed over
tp once per iteration, after the schedule, not in every micro-batch's backward: no all-reduce before the last
micro-batch (Megatron-SP activations move by all-gather and reduce-scatter).
"""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile, record_function

from galva_comm.testing import run_distributed
from galva_hp import BuildOptions, build
from galva_hp.testing.models import tiny_gpt
from galva_hp.testing.oracle import SEQ, VOCAB, batch
from galva_schema import Strategy

MARK = "test::first_layer_backward_done"
MICRO_BATCHES = 2


def _make():  # type: ignore[no-untyped-def]
    return tiny_gpt(vocab_size=VOCAB, hidden=32, heads=4, layers=6, seq_len=SEQ)


PLANS = {
    "dp2-ddp": dict(world_size=2, default_dp_type="ddp"),
    "dp2-zero2": dict(world_size=2, default_dp_type="zero2"),
    "pp2-dp2-ddp-1f1b": dict(world_size=4, pp=2, default_dp_type="ddp", pipeline_schedule="1f1b"),
    "pp2-dp2-ddp-gpipe": dict(world_size=4, pp=2, default_dp_type="ddp", pipeline_schedule="gpipe"),
    "tp2-megatron-sp": dict(world_size=2, layer={"tp": 2}, megatron_sp=True, default_dp_type="ddp"),
    "dp2-ddp-one-bucket": dict(world_size=2, default_dp_type="ddp"),
}


def trace(rank: int, world_size: int, names: list[str]) -> dict[str, list[str]]:
    """Per plan: this rank's collectives and backward markers during one forward_backward, in launch order."""
    ids, labels = batch(0)
    out = {}
    for name in names:
        fields = {"num_layers": 6, "global_batch_size": 8, "num_micro_batches": MICRO_BATCHES, **PLANS[name]}
        strategy = Strategy.uniform(mixed_precision="fp32", **fields)
        cap = {} if name.endswith("one-bucket") else {"bucket_cap_bytes": 0}
        built = build(_make(), strategy, BuildOptions(seq_len=SEQ, **cap))
        first = built.layers[str(built.layer_indices()[0])]

        def mark(*_: object) -> None:
            with record_function(MARK):
                pass

        first.register_full_backward_hook(mark)
        built.forward_backward(ids[0], labels[0])  # warm-up: FSDP2's lazy init, gloo connections
        for p in built.parameters():
            p.grad = None
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            built.forward_backward(ids[0], labels[0])
        events = sorted(
            (e for e in prof.events() if e.name == MARK or e.name.startswith("c10d::")),
            key=lambda e: e.time_range.start,
        )
        out[name] = [e.name for e in events]
    return out


def _reductions(events: list[str], kind: str) -> list[int]:
    return [i for i, e in enumerate(events) if kind in e]


def _marks(events: list[str]) -> list[int]:
    return [i for i, e in enumerate(events) if e == MARK]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("names", "world"),
    [
        (["dp2-ddp", "dp2-zero2", "tp2-megatron-sp", "dp2-ddp-one-bucket"], 2),
        (["pp2-dp2-ddp-1f1b", "pp2-dp2-ddp-gpipe"], 4),
    ],
)
def test_reduction_overlaps_the_last_backward_only(names: list[str], world: int) -> None:
    for rank, traces in enumerate(run_distributed(trace, world, names, timeout=120)):
        for name, events in traces.items():
            marks = _marks(events)
            assert len(marks) == MICRO_BATCHES, (name, rank, events)
            if name.startswith("tp2"):
                # Megatron-SP layers move activations by all-gather / reduce-scatter: an all-reduce before the last
                # micro-batch would be a per-micro-batch sum of the tp-replicated norms and biases
                reduces = _reductions(events, "allreduce")
                assert reduces and min(reduces) > marks[-2], f"{name} rank {rank}: summed every micro-batch: {events}"
                continue
            if name.endswith("one-bucket"):  # the whole stage's gradients, then the loss: two all-reduces
                reduces = _reductions(events, "allreduce")
                assert len(reduces) == 2 and min(reduces) > marks[-2], f"{name} rank {rank}: {events}"
                continue
            kind = "allreduce" if name.endswith(("ddp", "1f1b", "gpipe")) else "reduce_scatter"
            reduces = _reductions(events, kind)
            assert reduces, (name, rank, events)
            assert min(reduces) > marks[-2], f"{name} rank {rank}: reduced before the last micro-batch: {events}"
            assert min(reduces) < marks[-1], f"{name} rank {rank}: nothing reduced during the last backward: {events}"
