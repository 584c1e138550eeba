"""Gradient reduction of ddp units overlapped with the last backward of the iteration, as torch DDP does it.

Every ddp unit whose sharding group has more than one rank goes into a bucket; buckets are ordered in reverse layer
order (the order in which backward finishes them). Which units share one is
:func:`galva_comm.buckets.gradient_buckets` (consecutive units of one model chunk reduced over the same group in the
same dtype, up to the cap), the rule galva-search prices them by: each collective has a fixed cost (on gloo about a
CPU-millisecond per rank, whatever its size), so a model of small layers reduces its gradients in one all-reduce,
while layers of the cap's size or more keep one bucket each, overlapping the backward of earlier ones. During a
bucket's last micro-batch backward (the runtime *arms* the units of a model chunk before that chunk's last
backward), a post-accumulate hook on every parameter counts the parameters whose gradient is final; when all of a
bucket's are, the bucket's gradients are copied into one flat buffer (in the reduce dtype) and summed over the group
with an asynchronous all-reduce, while backward goes on with earlier layers. A split backward's weight pass writes
gradients without accumulate hooks; after a chunk's last one the runtime launches the chunk's buckets itself
(:meth:`BucketReducer.launch`). :meth:`BucketReducer.finish` (before the optimizer step) launches what has not been
launched (parameters that received no gradient), waits for every handle, and writes the sums into the gradients of
the master parameters. Earlier micro-batches only accumulate gradients locally.

Buckets are launched in bucket order on every rank (a ready bucket waits for its predecessors), so every rank
issues the collectives of a group in the same order; the ranks of a group hold the same layers with the same shapes,
so they make the same buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from galva_comm.buckets import gradient_buckets
from galva_hp.data_parallel import DdpUnit
from galva_hp.options import BuildOptions

__all__ = ["BUCKET_CAP_BYTES", "Bucket", "BucketReducer"]

BUCKET_CAP_BYTES = BuildOptions.bucket_cap_bytes
"""Units stop joining a bucket once it holds this many bytes of gradients (torch DDP's default ``bucket_cap_mb``)."""


@dataclass
class Bucket:
    """Consecutive units' gradients, reduced together over their group."""

    units: list[DdpUnit]
    params: list[nn.Parameter]  # compute parameters of every unit, in unit order
    nbytes: int = 0  # of the gradients in the reduce dtype
    ready: set[int] = field(default_factory=set)  # ids of params whose gradient is final this iteration
    armed: bool = False  # the units' last backward of the iteration has begun
    work: dist.Work | None = None
    flat: torch.Tensor | None = None
    present: list[int] = field(default_factory=list)  # indices of the params reduced (those with a gradient)

    @property
    def launched(self) -> bool:
        return self.flat is not None


class BucketReducer:
    """Asynchronous, backward-overlapped gradient all-reduce of ``units`` (the ddp units of one stage).

    ``chunk_of`` maps ``id(unit)`` to its model chunk (units the runtime arms apart never share a bucket; default:
    one chunk); ``cap_bytes`` is :data:`BUCKET_CAP_BYTES` unless given."""

    def __init__(
        self, units: list[DdpUnit], chunk_of: dict[int, int] | None = None, cap_bytes: int = BUCKET_CAP_BYTES
    ) -> None:
        self.units = units
        chunk_of = chunk_of or {}
        reduced = [u for u in units if u.group_size > 1 and not u.reduce_every_micro_batch]
        reduced.reverse()  # backward order
        params = [[p for p, _ in unit.grads_to_reduce()] for unit in reduced]
        nbytes = [sum(p.numel() for p in ps) * u.precision.reduce_dtype.itemsize for u, ps in zip(reduced, params)]
        keys = [(chunk_of.get(id(u), 0), id(u.group), u.precision.reduce_dtype) for u in reduced]
        self.buckets = [
            Bucket([reduced[i] for i in m], [p for i in m for p in params[i]], sum(nbytes[i] for i in m))
            for m in gradient_buckets(keys, nbytes, cap_bytes)
        ]
        self._next = 0  # index of the first bucket not yet launched
        self._handles = []
        for bucket in self.buckets:
            for param in bucket.params:
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(bucket)))

    def _hook(self, bucket: Bucket):  # type: ignore[no-untyped-def]
        def on_grad_final(param: torch.Tensor) -> None:
            if not bucket.armed:
                return
            bucket.ready.add(id(param))
            self._launch_ready()

        return on_grad_final

    def arm(self, units: Sequence[object] | None = None) -> None:
        """Called before the last micro-batch backward of ``units`` (default: all): the gradients it accumulates into
        their parameters are final."""
        for bucket in self._of(units):
            bucket.ready.clear()
            bucket.armed = True

    def launch(self, units: Sequence[object]) -> None:
        """The gradients of ``units`` are final (written by a split backward's weight pass): reduce them."""
        for bucket in self._of(units):
            bucket.armed = True
            bucket.ready = {id(p) for p in bucket.params}
        self._launch_ready()

    def _of(self, units: Sequence[object] | None) -> list[Bucket]:
        if units is None:
            return self.buckets
        ids = {id(u) for u in units}
        return [b for b in self.buckets if any(id(u) in ids for u in b.units)]

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        unit = bucket.units[0]  # the group and reduce dtype of every unit of the bucket
        bucket.present = [i for i, p in enumerate(bucket.params) if p.grad is not None]
        dtype = unit.precision.reduce_dtype
        grads = [bucket.params[i].grad.reshape(-1).to(dtype) for i in bucket.present]  # type: ignore[union-attr]
        bucket.flat = torch.cat(grads) if grads else torch.zeros(0, dtype=dtype)
        bucket.work = dist.all_reduce(bucket.flat, group=unit.group, async_op=True) if grads else None
        self._next += 1

    def finish(self) -> None:
        """Launch what backward did not, wait for every reduction, hand the sums to the master parameters."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            self._unpack(bucket)
        for unit in self.units:  # the unbucketed ones (one-rank groups, per-micro-batch reduction)
            unit.move_grads_to_masters()
        for bucket in self.buckets:  # next iteration: nothing final until its unit is armed again
            bucket.armed = False
            bucket.ready.clear()
        self._next = 0

    @staticmethod
    def _unpack(bucket: Bucket) -> None:
        assert bucket.flat is not None
        pairs = [pair for unit in bucket.units for pair in unit.grads_to_reduce()]
        offset = 0
        with torch.no_grad():
            for i in bucket.present:
                param, master = pairs[i]
                assert param.grad is not None
                n = param.grad.numel()
                piece = bucket.flat[offset : offset + n].view_as(param.grad)
                offset += n
                if master is param:
                    param.grad.copy_(piece)
                else:  # bf16 compute weights: the (fp32) sum goes straight to the fp32 master
                    piece = piece.to(master.dtype)
                    master.grad = piece.clone() if master.grad is None else master.grad + piece
                    param.grad = None
        bucket.flat, bucket.work = None, None
