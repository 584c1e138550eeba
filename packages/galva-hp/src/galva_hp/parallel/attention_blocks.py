"""One block of ring attention: the queries of one rank over one key/value block, with the block's log-sum-exp.

The ring merges blocks through their log-sum-exp, so each block runs a fused kernel that returns it:
``_scaled_dot_product_flash_attention_for_cpu`` on CPU (any float dtype, GQA, an additive mask); on CUDA the flash
kernel (fp16/bf16) or the memory-efficient one (fp32), without a mask; anything else (a masked block on CUDA, other
devices) runs the explicit fp32 path. Backward runs the kernel's backward with the whole row's output and
log-sum-exp (what the ring merged), which gives this block's exact share of the gradients.

:func:`plan_block` reduces a block's mask to what the kernel needs: the rectangle of query rows and key columns
that attend to anything (under a causal mask with one early and one late chunk per rank, a block is the diagonal
-- causal --, or half of its rows or half of its columns in full), and an additive mask only where the rectangle
is neither full nor causal (a sliding window's edge, padding).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["BlockPlan", "block_backward", "block_forward", "plan_block"]


class BlockPlan(NamedTuple):
    """What one block computes: query ``rows`` over key ``cols``, causal (square, top-left) or under ``allowed``."""

    rows: slice
    cols: slice
    causal: bool
    allowed: Tensor | None
    """``[batch or 1, heads or 1, rows, cols]`` bool where the rectangle is neither full nor causal, else None."""


def _span(any_: Tensor) -> slice:
    hits = torch.nonzero(any_).flatten().tolist()
    return slice(hits[0], hits[-1] + 1)


def plan_block(allowed: Tensor | None, q_len: int, k_len: int) -> BlockPlan | None:
    """The plan of a block whose mask is ``allowed`` (None: every pair attends); None if nothing attends."""
    if allowed is None:
        return BlockPlan(slice(0, q_len), slice(0, k_len), False, None)
    union = allowed.flatten(0, -3).any(0)  # [q, k]: any sample or head attends
    if not bool(union.any()):
        return None
    rows, cols = _span(union.any(1)), _span(union.any(0))
    sub = allowed[..., rows, cols]
    if bool(sub.all()):
        return BlockPlan(rows, cols, False, None)
    n, m = sub.shape[-2:]
    if n == m and bool((sub == torch.ones(n, m, dtype=torch.bool, device=sub.device).tril()).all()):
        return BlockPlan(rows, cols, True, None)
    return BlockPlan(rows, cols, False, sub)


def _bias(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _fused(q: Tensor, plan: BlockPlan) -> str:
    """The kernel for this block: ``cpu``, ``flash``, ``efficient`` or ``explicit``."""
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda" and plan.allowed is None:  # checked on a GPU by test_attention_blocks_devices.py
        return "flash" if q.dtype in (torch.float16, torch.bfloat16) else "efficient"
    return "explicit"


def _repeat(t: Tensor, groups: int) -> Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: Tensor, groups: int) -> Tensor:
    """The gradient of :func:`_repeat`: the copies of each key/value head summed."""
    if groups == 1:
        return t
    b, heads, n, d = t.shape
    return t.view(b, heads // groups, groups, n, d).sum(2)


def _allowed(plan: BlockPlan, n: int, m: int, device: torch.device) -> Tensor | None:
    if plan.causal:
        return torch.ones(n, m, dtype=torch.bool, device=device).tril()
    return plan.allowed


def block_forward(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, scale: float) -> tuple[Tensor, Tensor]:
    """The block's normalised output ``[b, h, rows, dv]`` (q's dtype) and log-sum-exp ``[b, h, rows]`` (fp32,
    -inf where a row attends to nothing). ``q``, ``k``, ``v`` are already cut to the plan's rows and columns."""
    kind = _fused(q, plan)
    if kind == "cpu":
        bias = None if plan.allowed is None else _bias(plan.allowed, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, plan.causal, attn_mask=bias, scale=scale
        )
    elif kind == "flash":
        groups = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, _repeat(k, groups), _repeat(v, groups), 0.0, plan.causal, False, scale=scale
        )[:2]
    elif kind == "efficient":
        groups = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _repeat(k, groups), _repeat(v, groups), None, True, 0.0, plan.causal, scale=scale
        )[:2]
        lse = lse[..., : q.shape[2]]  # padded to a multiple of 32 rows
    else:
        return _explicit_forward(q, k, v, _allowed(plan, q.shape[2], k.shape[2], q.device), scale)
    if plan.allowed is not None:  # the kernel gives a row that attends to nothing lse 0: make it -inf
        lse = lse.masked_fill(~plan.allowed.any(-1), float("-inf"))
    return out, lse


def block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: BlockPlan, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The block's share of the gradients of q, k, v, from the whole rows' output ``out`` and log-sum-exp ``lse``
    (finite: 0 where a row attends to nothing), all cut to the plan's rows and columns."""
    kind = _fused(q, plan)
    if kind == "cpu":
        bias = None if plan.allowed is None else _bias(plan.allowed, q.dtype)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, plan.causal, attn_mask=bias, scale=scale
        )
        return grads[0], grads[1], grads[2]
    if kind == "explicit":
        return _explicit_backward(dout, q, k, v, out, lse, _allowed(plan, q.shape[2], k.shape[2], q.device), scale)
    groups = q.shape[1] // k.shape[1]
    k_rep, v_rep = _repeat(k, groups), _repeat(v, groups)
    # the CUDA kernels read the log-sum-exp (and output) as dense [b, h, rows]: a block's rows are a strided view of
    # the ring's, which the flash kernel misread (dq off by 70x on an H200)
    out, lse, dout = out.contiguous(), lse.contiguous(), dout.contiguous()
    if kind == "flash":  # recomputes nothing random: dropout is off, so the rng state is unused
        cum_q, cum_k, seed, offset = _flash_extras(q.device, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k_rep, v_rep, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, plan.causal, seed, offset,
            scale=scale,
        )  # fmt: skip
    else:
        empty = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k_rep, v_rep, None, out, lse, empty, empty, 0.0, [True, True, True, False], plan.causal,
            scale=scale,
        )  # fmt: skip
    return dq, _fold(dk, groups), _fold(dv, groups)


@functools.lru_cache(maxsize=8)
def _flash_extras(device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, Any, Any]:
    """What the flash kernel's forward returns beside its output for a dense (not variable-length) batch -- the
    cumulative sequence lengths (undefined) and the rng state -- which its backward takes back as they came (an
    empty int64 tensor there means variable lengths: "cu_seqlens_q must have dtype int32", seen on an H200)."""
    probe = torch.zeros(1, 1, 8, 64, device=device, dtype=dtype)
    result = torch.ops.aten._scaled_dot_product_flash_attention(probe, probe, probe, 0.0, False, False)
    return result[2], result[3], result[6], result[7]


def _scores(q: Tensor, k: Tensor, allowed: Tensor | None, scale: float) -> Tensor:
    scores = torch.matmul(q.float(), _repeat(k.float(), q.shape[1] // k.shape[1]).transpose(-1, -2)) * scale
    return scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))


def _explicit_forward(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    scores = _scores(q, k, allowed, scale)
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite[..., None])
    return torch.matmul(probs, _repeat(v.float(), q.shape[1] // v.shape[1])).to(q.dtype), lse


def _explicit_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, allowed: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    groups = q.shape[1] // k.shape[1]
    dout32 = dout.float()
    probs = torch.exp(_scores(q, k, allowed, scale) - lse[..., None])
    delta = (dout32 * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax's Jacobian term
    dv = _fold(torch.matmul(probs.transpose(-1, -2), dout32), groups)
    dscores = probs * (torch.matmul(dout32, _repeat(v.float(), groups).transpose(-1, -2)) - delta)
    dq = torch.matmul(dscores, _repeat(k.float(), groups)) * scale
    dk = _fold(torch.matmul(dscores.transpose(-1, -2), q.float()), groups) * scale
    return dq, dk, dv
