"""Ulysses sequence parallelism: attention over the whole sequence from sequence-sharded activations.

The layer's input is ``[b, s/sp, hidden]`` on every rank of the sp group, and its weights are replicated (not split)
over that group: projections, norms and the MLP run on the local tokens. Around the attention, one all-to-all (q, k
and v together: one exchange, not three) scatters the heads and gathers the sequence (``[b, s/sp, h, d] ->
[b, s, h/sp, d]``), local attention (causal, or unmasked with ``causal=False``) runs on ``h/sp`` heads of the full
sequence, and one all-to-all takes the output back to ``[b, s/sp, h, d]``. Backward runs the inverse all-to-alls.

GQA: K/V are exchanged with their own head count when ``kv_heads % sp == 0`` (no repetition, so the all-to-all
moves ``kv_heads/heads`` of the query volume). Otherwise each K/V head is repeated ``r = lcm(kv_heads, sp)/kv_heads``
times (``repeat_interleave``, which keeps query head ``i`` on K/V head ``i // (heads/kv_heads)``) before the
exchange; the repeat's backward sums the copies' gradients. ``heads % sp == 0`` is required.

Weight gradients on each rank cover only its tokens: the runtime sums them over the layer's sharding group
(dp x sp, see :class:`galva_comm.layout.LayerGroups`), exactly like data parallelism.
"""

from __future__ import annotations

import math

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.parallel.attention import HeldHeadsAttention, Rotary
from galva_hp.parallel.mappings import differentiable_all_to_all, differentiable_all_to_all_many, group_size
from galva_schema.constraints import heads_problem

__all__ = ["UlyssesAttention", "ulysses_kv_repeat"]

_SEQ, _HEADS = 1, 2


def ulysses_kv_repeat(heads: int, kv_heads: int, sp: int) -> int:
    """How many times each K/V head is repeated before the Ulysses all-to-all (1 when ``sp`` divides kv_heads)."""
    if problem := heads_problem(heads, kv_heads, sp, ulysses=True):
        raise ValueError(problem)
    return math.lcm(kv_heads, sp) // kv_heads


class UlyssesAttention(HeldHeadsAttention):
    """Self-attention on sequence-sharded input with replicated projections ``q_proj/k_proj/v_proj/o_proj``.

    The projections are any modules mapping ``[b, s, hidden]`` to ``[b, s, heads*d]`` (``kv_heads*d`` for k and v)
    and back for ``o_proj``; they are used as given (pass copies). ``rotary`` is applied after the exchange, to the
    whole sequence. ``causal=False`` drops the causal mask (bidirectional encoders such as BERT and ViT); ``window``
    restricts causal attention to a sliding window of that many keys (Mistral, Qwen2), applied to the whole sequence.
    ``dropout``: attention-probability dropout in training, from this rank's own stream (it holds its own heads).
    """

    def __init__(
        self,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        o_proj: nn.Module,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        group: ProcessGroup | None,
        rotary: Rotary | None = None,
        causal: bool = True,
        window: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(rotary, causal, window, dropout)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.group = group
        self.kv_repeat = ulysses_kv_repeat(heads, kv_heads, group_size(group))

    def forward(self, x: Tensor) -> Tensor:
        b, s_local = x.shape[:2]
        d = self.head_dim
        q = self.q_proj(x).view(b, s_local, self.heads, d)
        k = self.k_proj(x).view(b, s_local, self.kv_heads, d)
        v = self.v_proj(x).view(b, s_local, self.kv_heads, d)
        if self.kv_repeat > 1:
            k = k.repeat_interleave(self.kv_repeat, dim=_HEADS)
            v = v.repeat_interleave(self.kv_repeat, dim=_HEADS)
        q, k, v = differentiable_all_to_all_many((q, k, v), _HEADS, _SEQ, self.group)  # one exchange
        out = self.attend(q, k, v, self.group)  # [b, s, heads/sp, d]: this rank's heads
        out = differentiable_all_to_all(out, _SEQ, _HEADS, self.group)  # [b, s/sp, heads, d]
        return self.o_proj(out.reshape(b, s_local, self.heads * d))
