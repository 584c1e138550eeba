"""Pipeline schedules over micro-batches: GPipe and 1F1B (PipeDream-flush), with p2p between consecutive stages.

Local rank ``i`` of stage ``s`` exchanges activations (forward) and their gradients (backward) with local rank ``i``
of stages ``s - 1`` and ``s + 1`` inside its pipeline group (:func:`galva_comm.layout.pipeline_groups`). Each
message is a small header (dtype and shape) followed by the tensor, so stages may hand over any layout, including the
sequence-sharded ones, without a shape table. Sends are non-blocking and waited for at the end of the iteration;
receives block, which is deadlock-free for both schedules because every send is posted before the matching
receive is needed. With ``pp == 1`` both schedules run forward and backward per micro-batch.

The schedule never scales gradients: the loss each micro-batch back-propagates is already divided by the global
token count (unlike ``torch.distributed.pipelining``, whose default divides by the number of micro-batches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from galva_schema import PipelineSchedule

__all__ = ["PipelineStage", "run_schedule", "schedule_order"]

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
_HEADER = 10  # dtype code, ndim, up to 8 dims
_TAG_FORWARD, _TAG_BACKWARD = 1, 2


@dataclass
class PipelineStage:
    """This rank's place in its pipeline: the group and the global ranks of its neighbours (None at the ends)."""

    stage: int
    num_stages: int
    group: dist.ProcessGroup | None = None
    prev_rank: int | None = None
    next_rank: int | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # of the p2p buffers
    _pending: list[Any] = field(default_factory=list, repr=False)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    # --------------------------------------------------------------------------------------------------- p2p
    def _send(self, tensor: Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        if tensor.ndim > _HEADER - 2:
            raise ValueError(f"cannot send a tensor of {tensor.ndim} dims between stages")
        values = [_DTYPES.index(tensor.dtype), tensor.ndim, *tensor.shape]
        header = torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64, device=self.device)
        # keep both tensors alive until the sends complete
        self._pending.append((dist.isend(header, dst, group=self.group, tag=tag), header))
        self._pending.append((dist.isend(tensor, dst, group=self.group, tag=tag), tensor))

    def _recv(self, src: int, tag: int) -> Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src, group=self.group, tag=tag)
        values = header.tolist()
        tensor = torch.empty(values[2 : 2 + values[1]], dtype=_DTYPES[values[0]], device=self.device)
        dist.recv(tensor, src, group=self.group, tag=tag)
        return tensor

    def send_forward(self, activation: Tensor) -> None:
        assert self.next_rank is not None
        self._send(activation, self.next_rank, _TAG_FORWARD)

    def recv_forward(self) -> Tensor:
        assert self.prev_rank is not None
        tensor = self._recv(self.prev_rank, _TAG_FORWARD)
        return tensor.requires_grad_(tensor.is_floating_point())

    def send_backward(self, grad: Tensor) -> None:
        assert self.prev_rank is not None
        self._send(grad, self.prev_rank, _TAG_BACKWARD)

    def recv_backward(self) -> Tensor:
        assert self.next_rank is not None
        return self._recv(self.next_rank, _TAG_BACKWARD)

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def schedule_order(schedule: PipelineSchedule, stage: int, num_stages: int, n: int) -> list[tuple[str, int]]:
    """The ("F"|"B", micro-batch) steps of one stage, in order."""
    if num_stages == 1:
        return [step for k in range(n) for step in (("F", k), ("B", k))]
    if schedule is PipelineSchedule.GPIPE:
        return [("F", k) for k in range(n)] + [("B", k) for k in range(n)]
    warmup = min(num_stages - stage - 1, n)
    order = [("F", k) for k in range(warmup)]
    for i in range(n - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", k) for k in range(n - warmup, n)]
    return order


def run_schedule(
    pipe: PipelineStage,
    schedule: PipelineSchedule,
    num_micro_batches: int,
    forward: Callable[[Tensor | None, int], Any],
    loss_of: Callable[[Any], Tensor],
    before_backward: Callable[[int, bool], None] = lambda k, sync: None,
    after_backward: Callable[[int, bool], None] = lambda k, sync: None,
) -> list[Any]:
    """Run one iteration's forwards and backwards on this stage; return the last stage's forward outputs.

    ``forward(received, k)`` runs the stage on micro-batch ``k`` (``received`` is None on the first stage) and returns
    the activation to send on, or on the last stage whatever ``loss_of`` turns into the scalar to back-propagate.
    ``before_backward(k, sync)`` / ``after_backward(k, sync)`` surround every backward; ``sync`` is true for the last
    backward of the iteration (data-parallel units reduce gradients then).
    """
    saved: dict[int, tuple[Tensor | None, Any]] = {}
    outputs: list[Any] = []
    order = schedule_order(schedule, pipe.stage, pipe.num_stages, num_micro_batches)
    last_backward = max(i for i, (kind, _) in enumerate(order) if kind == "B")
    for position, (kind, k) in enumerate(order):
        if kind == "F":
            received = None if pipe.is_first else pipe.recv_forward()
            out = forward(received, k)
            if pipe.is_last:
                outputs.append(out)
            else:
                pipe.send_forward(out)
            saved[k] = (received, out)
            continue
        received, out = saved.pop(k)
        sync = position == last_backward
        before_backward(k, sync)
        if pipe.is_last:
            loss_of(out).backward()
        else:
            grad = pipe.recv_backward()
            torch.autograd.backward(out, grad)
        after_backward(k, sync)
        if not pipe.is_first:
            assert received is not None and received.grad is not None, "stage input received no gradient"
            pipe.send_backward(received.grad)
    pipe.wait_sends()
    return outputs
