"""Local attention (causal or bidirectional) shared by every parallel form, and the rotary position embedding of the
Llama family.

Tensors are ``[batch, seq, heads, head_dim]``. The attention itself is ``scaled_dot_product_attention`` (works on
CPU with the math and flash kernels, on GPU with every backend); grouped-query attention uses its ``enable_gqa``
path, so K/V heads are never materialised ``heads / kv_heads`` times.

Sliding-window attention (Mistral, Qwen2): with ``window=w`` query ``i`` sees keys ``i-w < j <= i``, the band that
Hugging Face's ``sliding_window`` mask keeps. SDPA takes it as a boolean banded causal mask; on a GPU with flash-attn
installed and bf16/fp16 tensors, flash-attn's ``window_size=(w-1, 0)`` computes the same band without a mask. Every
parallel form calls this function on the whole sequence (Megatron tp gathers it, Ulysses exchanges heads for it), so
a window is exact in all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.parallel.rng import rank_stream

__all__ = ["HeldHeadsAttention", "Rotary", "RotaryEmbedding", "attention", "causal_attention", "sliding_window_mask"]

Rotary = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""Applies position information to ``(q, k)`` of the *whole* sequence (positions ``0 .. seq-1``)."""


def sliding_window_mask(seq: int, window: int, device: torch.device | None = None) -> Tensor:
    """``[seq, seq]`` boolean mask, True where query ``i`` may attend key ``j``: ``i - window < j <= i``."""
    i = torch.arange(seq, device=device).unsqueeze(1)
    j = torch.arange(seq, device=device).unsqueeze(0)
    return (j <= i) & (j > i - window)


def attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, window: int | None = None, dropout_p: float = 0.0
) -> Tensor:
    """Softmax attention, causal (decoders) or unmasked (``causal=False``: encoders such as BERT and ViT), optionally
    restricted to a causal sliding window of ``window`` keys: q ``[b, s, hq, d]``, k and v ``[b, s, hkv, d]`` with
    ``hq % hkv == 0``. ``dropout_p``: dropout on the attention probabilities, drawn from the global RNG (callers
    holding a shard of the heads wrap the call in :func:`galva_hp.parallel.rng.rank_stream`)."""
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    seq = q.shape[1]
    mask = None
    if window is not None and window < seq:
        if not causal:
            raise ValueError("a sliding window is only supported with causal attention")
        if _flash_ok(q):
            from flash_attn import flash_attn_func  # optional extra (GPU only)

            return flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True, window_size=(window - 1, 0))
        mask = sliding_window_mask(seq, window, q.device)  # causal too: is_causal must then be off
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal and mask is None,
        dropout_p=dropout_p,
        enable_gqa=hq != hkv,
    )
    return out.transpose(1, 2)


def _flash_ok(q: Tensor) -> bool:
    """flash-attn computes a window without a mask tensor: CUDA, half precision, and the package installed."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal softmax attention: :func:`attention` with ``causal=True``."""
    return attention(q, k, v, causal=True)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half convention, as in Llama), positions ``0 .. seq-1``."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.base = base

    def _cos_sin(self, seq: int, device: torch.device) -> tuple[Tensor, Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.base**exponents)
        angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [s, d]
        return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]

    @staticmethod
    def _rotate_half(x: Tensor) -> Tensor:
        first, second = x.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self._cos_sin(q.shape[1], q.device)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


class HeldHeadsAttention(nn.Module):
    """Base of the parallel attentions: attention on the heads this rank holds, over the whole sequence, with
    ``rotary`` (if any), the causal mask (none with ``causal=False``), a sliding ``window`` and attention-probability
    ``dropout`` in training, drawn from this rank's own stream in ``group`` (it holds its own heads, :mod:`.rng`)."""

    def __init__(self, rotary: Rotary | None, causal: bool, window: int | None, dropout: float) -> None:
        super().__init__()
        self.rotary, self.causal, self.window, self.dropout = rotary, causal, window, float(dropout)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup | None) -> Tensor:
        """``[b, s, heads, d]`` attention output of ``q``, ``k``, ``v`` (``[b, s, heads or kv_heads, d]``)."""
        if self.rotary is not None:
            q, k = self.rotary(q, k)
        p = self.dropout if self.training else 0.0
        with rank_stream(group, q.device) if p else contextlib.nullcontext():
            return attention(q, k, v, causal=self.causal, window=self.window, dropout_p=p)
