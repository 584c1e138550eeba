"""The ring's block kernels on every device: each context-parallel rank's blocks, computed by
:func:`~galva_hp.parallel.attention_blocks.block_forward` / ``block_backward`` on the plans the ring makes and merged
through their log-sum-exp as the ring merges them, equal attention over the whole sequence (outputs and the
gradients of q, k and v).

The ring itself (its messages) is pinned on gloo ranks by ``test_ring_attention.py``; this file runs the ring's block
schedule in one process so that the kernels a GPU takes (flash for bf16/fp16, memory-efficient for fp32, the explicit
path for a masked block) are checked without several GPUs. The CUDA rows skip without a GPU; the CPU rows check the
emulation itself.
"""

from __future__ import annotations

import pytest
import torch

from galva_hp.parallel.attention_blocks import block_backward, block_forward, plan_block
from galva_hp.parallel.ring_attention import RingMask, context_positions

HEADS = 4
SIZES = {"cpu": (32, 8), "cuda": (256, 64)}  # (sequence, head dim): small on CPU, kernel-sized on a GPU
BF16_BOUND = 2e-2  # galva-hp's bf16 bound; fp32 within 1e-5
CASES = {  # name: (kv heads, causal, window)
    "causal": (4, True, None),
    "causal-gqa": (2, True, None),
    "bidirectional-mqa": (1, False, None),
    "window": (2, True, 40),  # keys under 40 of every 256 positions back
}
_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROWS = [  # (device, dtype, cp): one CPU row checks the emulation; the GPU rows take each kernel
    ("cpu", torch.float32, 4),
    *(pytest.param("cuda", d, cp, marks=_GPU) for d in (torch.float32, torch.bfloat16) for cp in (2, 4)),
]


def _reference(q, k, v, grad, causal: bool, window: int | None):
    seq, dim = q.shape[2], q.shape[3]
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * dim**-0.5
    pos = torch.arange(seq, device=q.device)
    gap = pos[:, None] - pos[None, :]
    allowed = gap >= 0 if causal else torch.ones(seq, seq, dtype=torch.bool, device=q.device)
    if window is not None:
        allowed = allowed & (gap < window)
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(groups, 1)
    out.backward(grad.double())
    return out.detach(), q.grad, k.grad, v.grad


def _ring_in_one_process(q, k, v, grad, causal: bool, window: int | None, cp: int):
    """Every rank's blocks of a ring of ``cp``, each block on its plan's rectangle, merged as the ring merges."""
    seq, dim = q.shape[2], q.shape[3]
    mask, scale = RingMask(None, causal, window), dim**-0.5
    positions = [context_positions(seq, cp, r, device=q.device) for r in range(cp)]
    local = seq // cp
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    out = torch.zeros(*q.shape[:3], dim, dtype=torch.float32, device=q.device)
    for r in range(cp):
        qr, gr = q.index_select(2, positions[r]), grad.index_select(2, positions[r]).to(q.dtype)
        plans = []
        acc = torch.zeros(*qr.shape[:3], dim, dtype=torch.float32, device=q.device)
        lse = torch.full(qr.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for s in range(cp):
            allowed = mask.block(positions[r].cpu(), positions[s].cpu())
            plan = plan_block(allowed, local, local)
            if plan is None:
                continue
            if plan.allowed is not None:
                plan = plan._replace(allowed=plan.allowed.to(q.device))
            ks, vs = (t.index_select(2, positions[s])[:, :, plan.cols] for t in (k, v))
            block_out, block_lse = block_forward(qr[:, :, plan.rows], ks, vs, plan, scale)
            rows_lse = lse[:, :, plan.rows]
            merged = torch.logaddexp(rows_lse, block_lse)
            safe = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
            acc[:, :, plan.rows] = (
                acc[:, :, plan.rows] * torch.exp(rows_lse - safe)[..., None]
                + block_out.float() * (torch.exp(block_lse - safe)[..., None])
            )
            lse[:, :, plan.rows] = merged
            plans.append((s, plan))
        result = acc.to(q.dtype)
        out[:, :, positions[r]] = result.float()
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        for s, plan in plans:
            rows, cols = plan.rows, plan.cols
            ks, vs = (t.index_select(2, positions[s])[:, :, cols] for t in (k, v))
            bq, bk, bv = block_backward(
                gr[:, :, rows], qr[:, :, rows], ks, vs, result[:, :, rows], safe_lse[:, :, rows], plan, scale
            )
            dq[:, :, positions[r][rows]] += bq.float()
            dk[:, :, positions[s][cols]] += bk.float()
            dv[:, :, positions[s][cols]] += bv.float()
    return out, dq, dk, dv


@pytest.mark.parametrize(("device", "dtype", "cp"), ROWS)
def test_ring_blocks_equal_whole_sequence_attention(device: str, dtype: torch.dtype, cp: int):
    seq, dim = SIZES[device]
    for name, (kv, causal, window) in CASES.items():
        g = torch.Generator().manual_seed(5)
        q = torch.randn(2, HEADS, seq, dim, generator=g).to(device, dtype)
        k = torch.randn(2, kv, seq, dim, generator=g).to(device, dtype)
        v = torch.randn(2, kv, seq, dim, generator=g).to(device, dtype)
        grad = torch.randn(2, HEADS, seq, dim, generator=g).to(device, dtype)
        expected = _reference(q, k, v, grad, causal, window * seq // 256 if window else None)
        got = _ring_in_one_process(q, k, v, grad, causal, window * seq // 256 if window else None, cp)
        bound = 1e-5 if dtype == torch.float32 else BF16_BOUND
        for what, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
            diff = float((a.double() - b).abs().max() / b.abs().max())
            assert diff < bound, f"{device} {dtype} cp{cp} {name}: {what} relative difference {diff:.2e}"
