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
the key/value blocks travel as in forward, and their gradients travel with them, one hop behind, back to the rank
that owns them. GQA/MQA: key/value heads are sent unrepeated and repeated for the block's compute only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

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

    def __init__(self, group: ProcessGroup, index: int, local: int, device: torch.device) -> None:
        self.group, self.index = group, index
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (index + 1) % self.size)
        self.prev = dist.get_global_rank(group, (index - 1) % self.size)
        seq = local * self.size
        self.positions = [context_positions(seq, self.size, i, device) for i in range(self.size)]

    def source(self, step: int) -> int:
        """The context-parallel index whose block this rank holds at ``step``."""
        return (self.index - step) % self.size

    def shift(self, tensor: Tensor, tag: int) -> _InFlight:
        """Start sending ``tensor`` to the next rank and receiving the previous rank's into a new buffer."""
        received = torch.empty_like(tensor)
        # plain isend / irecv, not P2POp: P2POp accepts torch's own functions only, not the watchdog's wrappers
        send = dist.isend(tensor, self.next, group=self.group, tag=tag)
        recv = dist.irecv(received, self.prev, group=self.group, tag=tag)
        return _InFlight(received, [send, recv], tensor)


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


def _repeat(t: Tensor, groups: int) -> Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: Tensor, groups: int) -> Tensor:
    """The gradient of :func:`_repeat`: the copies of each key/value head summed."""
    if groups == 1:
        return t
    b, heads, n, d = t.shape
    return t.view(b, heads // groups, groups, n, d).sum(2)


def _scores(q: Tensor, k: Tensor, allowed: Tensor | None, scale: float) -> Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def _finite(lse: Tensor) -> Tensor:
    """``lse`` with -inf (a row that attends to nothing yet) replaced by 0, to subtract from safely."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


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
        ring = _Ring(group, index, query.shape[2], query.device)
        groups = query.shape[1] // key.shape[1]
        q = query.float()
        q_pos = ring.positions[index]
        out = q.new_zeros(*q.shape[:3], value.shape[-1])
        lse = q.new_full(q.shape[:3], float("-inf"))
        blocks: tuple[Tensor, ...] = (key, value)
        for step in range(ring.size):
            pending = ring.shift(_pack(*blocks), _KV_TAG) if step + 1 < ring.size else None
            k, v = blocks
            allowed = mask.block(q_pos, ring.positions[ring.source(step)])
            if allowed is None or bool(allowed.any()):
                scores = _scores(q, _repeat(k.float(), groups), allowed, scale)
                block_lse = torch.logsumexp(scores, dim=-1)
                probs = torch.exp(scores - _finite(block_lse)[..., None])
                block_out = torch.matmul(probs, _repeat(v.float(), groups))  # normalised: rows sum to 1 (or 0)
                merged = torch.logaddexp(lse, block_lse)
                safe = _finite(merged)
                out = out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None]
                lse = merged
            if pending is not None:
                blocks = tuple(_unpack(pending.wait(), blocks))
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mask, ctx.group, ctx.index, ctx.scale = mask, group, index, scale
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group, ctx.index, query.shape[2], query.device)
        groups = query.shape[1] // key.shape[1]
        q, dout = query.float(), grad_out.float()
        q_pos = ring.positions[ctx.index]
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax's Jacobian term
        safe_lse = _finite(lse)[..., None]
        dq = torch.zeros_like(q)
        blocks: tuple[Tensor, ...] = (key, value)
        pending_grads: _InFlight | None = None
        for step in range(ring.size):
            pending = ring.shift(_pack(*blocks), _KV_TAG) if step + 1 < ring.size else None
            k, v = blocks
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            allowed = ctx.mask.block(q_pos, ring.positions[ring.source(step)])
            if allowed is None or bool(allowed.any()):
                k_rep, v_rep = _repeat(k.float(), groups), _repeat(v.float(), groups)
                probs = torch.exp(_scores(q, k_rep, allowed, ctx.scale) - safe_lse)
                dv = _fold(torch.matmul(probs.transpose(-1, -2), dout), groups)
                dscores = probs * (torch.matmul(dout, v_rep.transpose(-1, -2)) - delta)
                dq += torch.matmul(dscores, k_rep) * ctx.scale
                dk = _fold(torch.matmul(dscores.transpose(-1, -2), q), groups) * ctx.scale
            if pending_grads is not None:  # what the earlier ranks added to this block
                earlier_dk, earlier_dv = _unpack(pending_grads.wait(), (dk, dv))
                dk, dv = dk + earlier_dk, dv + earlier_dv
            # on to the next rank, which holds this block at the next step (the last hop takes it home)
            pending_grads = ring.shift(_pack(dk, dv), _GRAD_TAG)
            if pending is not None:
                blocks = tuple(_unpack(pending.wait(), blocks))
        assert pending_grads is not None
        dkey, dvalue = _unpack(pending_grads.wait(), (key, value))  # this rank's own block, home from its round
        return dq.to(query.dtype), dkey.to(key.dtype), dvalue.to(value.dtype), None, None, None, None
