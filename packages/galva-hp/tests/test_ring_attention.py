"""Ring attention on 2 and 4 gloo ranks equals attention over the whole sequence in one process (fp32): outputs and
the gradients of q, k and v, for causal and bidirectional masks, GQA and MQA, a sliding window, a padding mask; bf16
within galva-hp's bf16 bound."""

from __future__ import annotations

import pytest
import torch

from galva_comm.testing import run_distributed

SEQ, HEADS, DIM = 32, 4, 8

CASES = {
    # name: (kv heads, causal, window, padded)
    "causal": (4, True, None, False),
    "causal-gqa": (2, True, None, False),
    "bidirectional-mqa": (1, False, None, False),
    "window": (2, True, 5, False),
    "padded-mask": (2, True, None, True),
    "causal-gqa-bf16": (2, True, None, False),
}
BF16_BOUND = 2e-2  # galva-hp's bf16 bound (grad norms); every fp32 case within 1e-5


def _inputs(kv: int, padded: bool):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, HEADS, SEQ, DIM, generator=g)
    k = torch.randn(2, kv, SEQ, DIM, generator=g)
    v = torch.randn(2, kv, SEQ, DIM, generator=g)
    grad = torch.randn(2, HEADS, SEQ, DIM, generator=g)
    mask = None
    if padded:  # the second sample's first 3 tokens are padding: no query attends to them
        pos = torch.arange(SEQ)
        mask = (pos[None, :] <= pos[:, None]).expand(2, 1, SEQ, SEQ).clone()
        mask[1, :, :, :3] = False
        mask[1, :, :3, :3] = torch.eye(3, dtype=torch.bool)  # padding rows attend to themselves
    return q, k, v, grad, mask


def _reference(q, k, v, grad, causal: bool, window: int | None, mask):
    q, k, v, grad = (t.float() for t in (q, k, v, grad))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * DIM**-0.5
    pos = torch.arange(SEQ)
    gap = pos[:, None] - pos[None, :]
    allowed = mask if mask is not None else (gap >= 0 if causal else torch.ones(SEQ, SEQ, dtype=torch.bool))
    if window is not None:
        allowed = allowed & (gap < window)
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(groups, 1)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _compare(rank: int, world_size: int) -> dict[str, float]:
    import torch.distributed as dist

    from galva_hp.parallel.ring_attention import RingMask, context_positions, ring_attention

    worst = {}
    for name, (kv, causal, window, padded) in CASES.items():
        q, k, v, grad, mask = _inputs(kv, padded)
        if name.endswith("bf16"):  # the reference in fp32 from the same bf16 inputs
            q, k, v, grad = (t.bfloat16() for t in (q, k, v, grad))
        expected = _reference(q, k, v, grad, causal, window, mask)
        pos = context_positions(SEQ, world_size, rank)
        local = [t.index_select(2, pos).clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, RingMask(mask, causal, window), dist.group.WORLD, rank, DIM**-0.5)
        out.backward(grad.index_select(2, pos).to(out.dtype))
        got = (out.detach(), *(t.grad for t in local))
        worst[name] = max(
            float((a.float() - b.index_select(2, pos)).abs().max() / b.abs().max())
            for a, b in zip(got, expected, strict=True)
        )
    return worst


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [4])
def test_ring_attention_equals_whole_sequence_attention(world_size: int):
    for rank, worst in enumerate(run_distributed(_compare, world_size, timeout=120)):
        for name, diff in worst.items():
            assert diff < (BF16_BOUND if name.endswith("bf16") else 1e-5), (
                f"rank {rank}, {name}: relative difference {diff:.2e}"
            )


def test_context_positions_are_one_early_and_one_late_chunk():
    from galva_hp.parallel.ring_attention import context_positions

    assert context_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="cannot be split into 8 equal parts"):
        context_positions(12, 4, 0)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, None), (True, 5)])
def test_block_plans_cover_the_mask_and_need_no_mask_under_plain_causal(cp: int, causal: bool, window: int | None):
    """Each block's plan (rectangle, causal, mask) allows exactly the block's pairs; a plain causal or bidirectional
    ring runs every block unmasked (full or causal), so the fused kernel never takes a mask there."""
    from galva_hp.parallel.attention_blocks import plan_block
    from galva_hp.parallel.ring_attention import RingMask, context_positions

    mask, local = RingMask(None, causal, window), SEQ // cp
    for r in range(cp):
        for s in range(cp):
            allowed = mask.block(context_positions(SEQ, cp, r), context_positions(SEQ, cp, s))
            expected = torch.ones(local, local, dtype=torch.bool) if allowed is None else allowed[0, 0]
            plan = plan_block(allowed, local, local)
            got = torch.zeros(local, local, dtype=torch.bool)
            if plan is not None:
                n, m = plan.rows.stop - plan.rows.start, plan.cols.stop - plan.cols.start
                inner = torch.ones(n, m, dtype=torch.bool)
                inner = inner.tril() if plan.causal else inner if plan.allowed is None else plan.allowed[0, 0]
                got[plan.rows, plan.cols] = inner
                assert window is not None or plan.allowed is None, f"block {r}<-{s} needs a mask"
            assert torch.equal(got, expected), f"cp {cp}, block {r}<-{s}"
