"""Context parallelism: attention over the whole sequence from ranks that each hold two chunks of it (a ring).

Each rank of a context-parallel group of degree ``cp`` holds the query, key and value of its context-local
sequence: chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp`` (:func:`galva_schema.sharding.context_chunks`, one early
and one late, so under a causal mask every rank attends over the same number of pairs). Key/value blocks travel
round the ring: at step ``t`` rank ``r`` attends to the block of rank ``r - t`` while the next block is already on
its way (``isend`` / ``irecv``, overlapped with the block's compute). Each block's partial attention is merged into
the running output through its log-sum-exp (online softmax, in fp32). A block whose mask allows nothing (above the
causal diagonal, outside a sliding window) is not computed.

The mask of a block is the whole-sequence mask (``[batch, 1 or heads, seq, seq]``, True where a query may attend)
at the block's query and key positions; with no mask, positions decide (causal, a sliding window, or everything).

Backward (:class:`_RingAttention`) keeps only q, k, v, the output and its log-sum-exp, and runs the ring again:
the key/value blocks travel as in forward, and the gradients of each block go straight home to the rank that owns
it (one message per block, sent while the next block is computed). Each block runs a fused kernel that returns its
log-sum-exp, on the rectangle of the block that attends (:mod:`galva_hp.parallel.attention_blocks`); key/value
heads travel unrepeated (GQA/MQA). The key/value pair is packed into one buffer once and each received buffer is
sent on as it came.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from galva_hp.parallel.attention_blocks import BlockPlan, block_backward, block_forward, plan_block
from galva_schema.sharding import sequence_blocks

__all__ = ["RingMask", "context_positions", "ring_attention"]

_KV_TAG, _GRAD_TAG = 71, 72


def context_positions(seq_len: int, cp: int, index: int, device: torch.device | None = None) -> Tensor:
    """The positions of a ``seq_len``-token sequence in context-parallel index ``index``'s local sequence."""
    blocks = sequence_blocks(seq_len, cp, 1, index, 0)
    return torch.cat([torch.arange(b.start, b.stop, device=device) for b in blocks])


class RingMask:
    """Which key positions each query position may attend to, block by block.

    ``mask`` is the whole-sequence mask (bool, True = attend; a float mask is additive: 0 = attend), or None:
    then ``causal`` and ``window`` (keys less than ``window`` positions back) decide.
    """

    def __init__(self, mask: Tensor | None, causal: bool, window: int | None = None) -> None:
        if mask is not None and mask.dtype != torch.bool:
            mask = mask == 0
        self.mask, self.causal, self.window = mask, causal, window

    def block(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """``[batch or 1, heads or 1, q, k]`` bool, or None where every pair may attend."""
        if self.mask is not None:
            q_pos, k_pos = q_pos.to(self.mask.device), k_pos.to(self.mask.device)
            return self.mask.index_select(-2, q_pos).index_select(-1, k_pos)
        if not self.causal and self.window is None:
            return None
        gap = q_pos[:, None] - k_pos[None, :]
        allowed = gap >= 0 if self.causal else torch.ones_like(gap, dtype=torch.bool)
        if self.window is not None:
            allowed &= gap < self.window
        return allowed[None, None]


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: RingMask,
    group: ProcessGroup,
    index: int,
    scale: float,
) -> Tensor:
    """Attention of this rank's queries over the whole sequence of the ring ``group`` (this rank: ``index``).

    ``query`` is ``[batch, heads, local, head_dim]``, ``key``/``value`` ``[batch, kv_heads, local, dim]`` (the
    context-local sequence); returns ``[batch, heads, local, value_dim]`` in the query's dtype.
    """
    return _RingAttention.apply(query, key, value, mask, group, index, scale)


class _Ring:
    """The ring's peers and block positions for one call."""

    def __init__(self, group: ProcessGroup, index: int, local: int) -> None:
        self.group, self.index = group, index
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (index + 1) % self.size)
        self.prev = dist.get_global_rank(group, (index - 1) % self.size)
        seq = local * self.size
        self.local = local
        self.positions = [context_positions(seq, self.size, i) for i in range(self.size)]  # on CPU: plans read them

    def source(self, step: int) -> int:
        """The context-parallel index whose block this rank holds at ``step``."""
        return (self.index - step) % self.size

    def plan(self, mask: RingMask, step: int, device: torch.device) -> BlockPlan | None:
        """What this rank's queries compute over the block it holds at ``step`` (None: nothing attends)."""
        if mask.mask is None:  # positions decide: the same plan every layer and step
            plan = _position_plan(
                self.local * self.size, self.size, self.index, self.source(step), mask.causal, mask.window
            )
        else:
            allowed = mask.block(self.positions[self.index], self.positions[self.source(step)])
            plan = plan_block(allowed, self.local, self.local)
        if plan is not None and plan.allowed is not None and plan.allowed.device != device:
            plan = plan._replace(allowed=plan.allowed.to(device))
        return plan

    def shift(self, tensor: Tensor, tag: int) -> _InFlight:
        """Start sending ``tensor`` to the next rank and receiving the previous rank's into a new buffer."""
        received = torch.empty_like(tensor)
        # plain isend / irecv, not P2POp: P2POp accepts torch's own functions only, not the watchdog's wrappers
        send = dist.isend(tensor, self.next, group=self.group, tag=tag)
        recv = dist.irecv(received, self.prev, group=self.group, tag=tag)
        return _InFlight(received, [send, recv], tensor)

    def home(self, tensor: Tensor, step: int, tag: int) -> _InFlight:
        """Start sending ``tensor`` (gradients of the block held at ``step``) to its owner, and receiving the
        gradients of this rank's block from the rank that held it at ``step``."""
        received = torch.empty_like(tensor)
        owner = dist.get_global_rank(self.group, self.source(step))
        holder = dist.get_global_rank(self.group, (self.index + step) % self.size)
        send = dist.isend(tensor, owner, group=self.group, tag=tag)
        recv = dist.irecv(received, holder, group=self.group, tag=tag)
        return _InFlight(received, [send, recv], tensor)


@functools.lru_cache(maxsize=256)
def _position_plan(seq: int, size: int, index: int, source: int, causal: bool, window: int | None) -> BlockPlan | None:
    mask = RingMask(None, causal, window)
    local = seq // size
    return plan_block(
        mask.block(context_positions(seq, size, index), context_positions(seq, size, source)), local, local
    )


class _InFlight(NamedTuple):
    """One shift round the ring: what is being received, and what is being sent (kept alive until it is sent)."""

    received: Tensor
    works: list[Any]
    sent: Tensor

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        return self.received


def _pack(*tensors: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: Tensor, like: tuple[Tensor, ...]) -> list[Tensor]:
    """The tensors :func:`_pack` packed, shaped like ``like`` (in ``flat``'s dtype)."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def _finite(lse: Tensor) -> Tensor:
    """``lse`` with -inf (a row that attends to nothing yet) replaced by 0, to subtract from safely."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Merge a block's normalised output and log-sum-exp into the running ones (views of its rows), in place."""
    merged = torch.logaddexp(lse, block_lse)
    safe = _finite(merged)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(block_out.float() * torch.exp(block_lse - safe)[..., None])
    lse.copy_(merged)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: RingMask,
        group: ProcessGroup,
        index: int,
        scale: float,
    ) -> Tensor:
        ring = _Ring(group, index, query.shape[2])
        out = query.new_zeros(*query.shape[:3], value.shape[-1], dtype=torch.float32)
        lse = query.new_full(query.shape[:3], float("-inf"), dtype=torch.float32)
        flat = _pack(key, value)  # packed once: each received block is sent on as it came
        for step in range(ring.size):
            pending = ring.shift(flat, _KV_TAG) if step + 1 < ring.size else None
            plan = ring.plan(mask, step, query.device)
            if plan is not None:
                k, v = (t[:, :, plan.cols] for t in _unpack(flat, (key, value)))
                block_out, block_lse = block_forward(query[:, :, plan.rows], k, v, plan, scale)
                _merge(out[:, :, plan.rows], lse[:, :, plan.rows], block_out, block_lse)
            if pending is not None:
                flat = pending.wait()
        result = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, result, lse)
        ctx.mask, ctx.group, ctx.index, ctx.scale = mask, group, index, scale
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group, ctx.index, query.shape[2])
        dout = grad_out.to(query.dtype)
        safe_lse = _finite(lse)
        dq = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        flat = _pack(key, value)
        own = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)  # this rank's block's gradients
        homing: _InFlight | None = None
        for step in range(ring.size):
            pending = ring.shift(flat, _KV_TAG) if step + 1 < ring.size else None
            grads = own if step == 0 else torch.zeros_like(own)
            plan = ring.plan(ctx.mask, step, query.device)
            if plan is not None:
                r, c = plan.rows, plan.cols
                k, v = (t[:, :, c] for t in _unpack(flat, (key, value)))
                block_dq, block_dk, block_dv = block_backward(
                    dout[:, :, r], query[:, :, r], k, v, out[:, :, r], safe_lse[:, :, r], plan, ctx.scale
                )
                dk, dv = _unpack(grads, (key, value))
                dq[:, :, r] += block_dq
                dk[:, :, c] += block_dk
                dv[:, :, c] += block_dv
            if step > 0:  # straight to the block's owner: one hop, one message per block
                if homing is not None:
                    own += homing.wait()
                homing = ring.home(grads, step, _GRAD_TAG)
            if pending is not None:
                flat = pending.wait()
        if homing is not None:
            own += homing.wait()
        dkey, dvalue = _unpack(own, (key, value))
        return dq.to(query.dtype), dkey.to(key.dtype), dvalue.to(value.dtype), None, None, None, None
