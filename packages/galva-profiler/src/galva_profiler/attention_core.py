"""The attention core of a layer timed apart from its linear parts: scores, softmax and the weighted values of
``[batch, heads, seq, head_dim]`` queries against the key/value heads, at several sequence lengths, fitted by a
quadratic per sample (what context parallelism's ring splits into blocks: its steps are priced from this fit)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.functional import scaled_dot_product_attention

from galva_profiler.fitting import quadratic
from galva_profiler.layer_timing import time_passes
from galva_profiler.timing import Repeats
from galva_schema import AttentionCoreProfile, SequenceTime


def core_lengths(seq_lengths: tuple[int, ...]) -> tuple[int, ...]:
    """The lengths to time: the profiled ones and, below each, its half and quarter (a quadratic needs three)."""
    out = {s // k for s in seq_lengths for k in (1, 2, 4) if s // k >= 1}
    return tuple(sorted(out))


def _core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, causal: bool) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        for t in (q, k, v):
            t.grad = None
        keys, values = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (k, v))
        return scaled_dot_product_attention(q, keys, values, is_causal=causal)

    return run


def measure_attention_core(
    heads: int,
    kv_heads: int,
    head_dim: int,
    causal: bool,
    seq_lengths: tuple[int, ...],
    batch: int,
    dtype: torch.dtype,
    repeats: Repeats,
    device: torch.device | None = None,
) -> AttentionCoreProfile:
    """Forward ms per sample of the attention core at each of :func:`core_lengths`, fitted as ``a s^2 + b s + c``;
    key/value bytes per token from the heads (tp 1); on ``device`` (CPU by default)."""
    lengths = core_lengths(seq_lengths)
    per_sample = []
    for seq in lengths:
        q = torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
        # the key/value heads repeated to the query heads, as an attention without grouped kernels computes them
        k = torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
        v = torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True)

        per_sample.append(time_passes(_core(q, k, v, heads // kv_heads, causal), repeats, device).forward_ms / batch)
    if len(lengths) >= 3:
        a, b, c = quadratic(lengths, per_sample).coefficients
    else:  # a sequence of 1 or 2 tokens: the core is all quadratic
        a, b, c = per_sample[-1] / lengths[-1] ** 2, 0.0, 0.0
    element = torch.tensor([], dtype=dtype).element_size()
    return AttentionCoreProfile(
        forward_time=SequenceTime(coefficients=(a, b, c)),
        kv_bytes_per_token=2 * kv_heads * head_dim * element,
        causal=causal,
        seq_lengths=lengths,
    )
