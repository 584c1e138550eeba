"""Tiny GPT and Llama models (plain torch, fp32, deterministic from a seed) with a parallelizer for every mode.

    model = tiny_gpt()                       # or tiny_llama()
    ids, labels = random_batch(model, batch=4, seed=1)
    reference = model.reference_loss(ids, labels)        # single-process oracle
    ctx = ParallelContext(tp_group=tp, megatron_sp=True)
    layer = model.parallelizer.layer(model.layers[0], model.layer_types[0], ctx)

``tiny_gpt``: learned positions, LayerNorm, GELU MLP, biases everywhere, head tied to the word embedding.
``tiny_llama``: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases, untied head.

Module and parameter names (kept by the parallel forms where the tensor is unchanged):

- embedding: ``wte.weight`` (word), ``wpe.weight`` (positions, GPT only)
- layer: ``norm1``, ``attn.{q_proj,k_proj,v_proj,o_proj}``, ``norm2``, ``mlp.{fc_in,fc_out}`` (GPT) or
  ``mlp.{gate_proj,up_proj,down_proj}`` (Llama). Tensor-parallel forms fuse ``attn.qkv`` and ``mlp.up``
  (megatron ColumnParallelLinear) and hold ``attn.o_proj`` / ``mlp.down`` (RowParallelLinear).
- head: ``norm``, ``lm_head.weight``; GPT ties ``embedding.wte.weight`` and ``head.lm_head.weight``.

Parallel forms never share parameters with the module they were made from, nor with each other: with a tied
head the runtime keeps ``embedding.wte.weight`` and ``head.lm_head.weight`` equal (sum their gradients) itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.model import LayeredModel, ParallelContext
from galva_hp.parallel.attention import RotaryEmbedding, causal_attention
from galva_hp.parallel.mappings import differentiable_copy_to_group, group_rank
from galva_hp.parallel.tensor_parallel import TensorParallelAttention, TensorParallelMLP, sequence_parallel_norm
from galva_hp.parallel.ulysses import UlyssesAttention
from galva_hp.parallel.vocab import IGNORE_INDEX, VocabParallelEmbedding, VocabParallelHead, token_loss_sum
from galva_hp.shared_params import embedding_ties
from galva_schema.constraints import uniform_constraints

__all__ = [
    "TinyAttention",
    "TinyEmbedding",
    "TinyHead",
    "TinyLayer",
    "TinyMLP",
    "TinyParallelizer",
    "random_batch",
    "tiny_gpt",
    "tiny_llama",
]


# --------------------------------------------------------------------------------------- single-process modules
class TinyEmbedding(nn.Module):
    """Word embedding (+ learned positions). ``wte`` may be a :class:`VocabParallelEmbedding` in parallel forms.

    Positions start at ``rank_in(seq_group) * local_seq``: the sequence slice this rank holds (0 single-process).
    ``position_grad_group``: the group over which the position table's gradient is summed (Megatron-SP, where the
    table is replicated over tp but each rank adds only its slice's rows).
    """

    def __init__(
        self,
        wte: nn.Embedding | VocabParallelEmbedding,
        wpe: nn.Embedding | None,
        seq_group: ProcessGroup | None = None,
        position_grad_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe
        self.seq_group, self.position_grad_group = seq_group, position_grad_group

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden = self.wte(input_ids)
        if self.wpe is None:
            return hidden
        local = hidden.shape[1]
        start = group_rank(self.seq_group) * local
        positions = torch.arange(start, start + local, device=input_ids.device)
        return hidden + F.embedding(positions, differentiable_copy_to_group(self.wpe.weight, self.position_grad_group))


class TinyAttention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections, optional RoPE and GQA."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, bias: bool, rotary: bool) -> None:
        super().__init__()
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"hidden={hidden}, heads={heads}, kv_heads={kv_heads} do not divide")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        d = self.head_dim
        self.q_proj = nn.Linear(hidden, heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(heads * d, hidden, bias=bias)
        self.rotary = RotaryEmbedding(d) if rotary else None

    def forward(self, x: Tensor) -> Tensor:
        b, s = x.shape[:2]
        d = self.head_dim
        q = self.q_proj(x).view(b, s, self.heads, d)
        k = self.k_proj(x).view(b, s, self.kv_heads, d)
        v = self.v_proj(x).view(b, s, self.kv_heads, d)
        if self.rotary is not None:
            q, k = self.rotary(q, k)
        return self.o_proj(causal_attention(q, k, v).reshape(b, s, self.heads * d))


def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def _gelu(x: Tensor) -> Tensor:
    return F.gelu(x)


class TinyMLP(nn.Module):
    """``kind="gelu"``: fc_out(gelu(fc_in(x))); ``kind="swiglu"``: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden: int, ffn: int, kind: str, bias: bool) -> None:
        super().__init__()
        self.kind = kind
        if kind == "gelu":
            self.fc_in = nn.Linear(hidden, ffn, bias=bias)
            self.fc_out = nn.Linear(ffn, hidden, bias=bias)
        elif kind == "swiglu":
            self.gate_proj = nn.Linear(hidden, ffn, bias=bias)
            self.up_proj = nn.Linear(hidden, ffn, bias=bias)
            self.down_proj = nn.Linear(ffn, hidden, bias=bias)
        else:
            raise ValueError(f"unknown MLP kind {kind!r}")

    def projection_names(self) -> tuple[list[str], str]:
        """Names of the input projections and of the output projection (as in :meth:`up_and_down`)."""
        if self.kind == "gelu":
            return ["fc_in"], "fc_out"
        return ["gate_proj", "up_proj"], "down_proj"

    def up_and_down(self) -> tuple[list[nn.Linear], nn.Linear, Callable[..., Tensor]]:
        """(input projections, output projection, activation over the input projections' outputs)."""
        if self.kind == "gelu":
            return [self.fc_in], self.fc_out, _gelu
        return [self.gate_proj, self.up_proj], self.down_proj, _swiglu

    def forward(self, x: Tensor) -> Tensor:
        ups, down, activation = self.up_and_down()
        return down(activation(*(up(x) for up in ups)))


class TinyLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm1(x))``, then ``+ mlp(norm2(.))``. Parallel forms swap submodules."""

    def __init__(self, norm1: nn.Module, attn: nn.Module, norm2: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyHead(nn.Module):
    """Final norm + LM head + summed token cross-entropy: ``(hidden, labels) -> (loss_sum, token_count)``."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        return token_loss_sum(self.lm_head(self.norm(hidden)), labels)


# ------------------------------------------------------------------------------------------------ parallelizer
class TinyParallelizer:
    """Parallel forms of the tiny models' modules (see :class:`galva_hp.model.Parallelizer`).

    layer: Ulysses when ``ctx.sp_size > 1``; Megatron tp (+ SP with ``ctx.megatron_sp``) when ``ctx.tp_size > 1``;
    otherwise a plain copy. embedding/head: vocab sp when ``ctx.vocab_sp``; vocab tp (+ SP) when tp > 1.
    """

    def __init__(self, heads: int, kv_heads: int) -> None:
        self.heads, self.kv_heads = heads, kv_heads

    def layer(self, module: nn.Module, layer_type: str, ctx: ParallelContext) -> nn.Module:
        if not isinstance(module, TinyLayer):
            raise TypeError(f"tiny parallelizer got a {type(module).__name__} for layer type {layer_type!r}")
        if ctx.tp_size > 1 and ctx.sp_size > 1:
            raise ValueError("a layer is either Megatron tp or Ulysses sp, not both")
        if ctx.sp_size > 1:
            return self._ulysses_layer(module, ctx.sp_group)
        if ctx.tp_group is not None and ctx.tp_size > 1:  # tp_size > 1 implies a group; this narrows it
            return self._tp_layer(module, ctx.tp_group, ctx.megatron_sp)
        return copy.deepcopy(module)

    def embedding(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        if not isinstance(module, TinyEmbedding):
            raise TypeError(f"tiny parallelizer got a {type(module).__name__} as embedding")
        wpe = copy.deepcopy(module.wpe)
        if ctx.vocab_sp:
            if ctx.tp_size > 1:
                raise ValueError("vocab sp and vocab tp cannot be combined")
            return TinyEmbedding(copy.deepcopy(module.wte), wpe, seq_group=ctx.sp_group)
        if ctx.tp_size > 1:
            sp = ctx.megatron_sp
            wte = VocabParallelEmbedding(module.wte.weight, ctx.tp_group, sequence_parallel=sp)
            tp = ctx.tp_group if sp else None
            return TinyEmbedding(wte, wpe, seq_group=tp, position_grad_group=tp)
        return TinyEmbedding(copy.deepcopy(module.wte), wpe)

    def head(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        if not isinstance(module, TinyHead):
            raise TypeError(f"tiny parallelizer got a {type(module).__name__} as head")
        if ctx.vocab_sp:
            if ctx.tp_size > 1:
                raise ValueError("vocab sp and vocab tp cannot be combined")
            return copy.deepcopy(module)  # the local tokens' loss with full weights: nothing to change
        if ctx.tp_size > 1:
            return VocabParallelHead(
                module.norm, module.lm_head.weight, ctx.tp_group, ctx.megatron_sp, module.lm_head.bias
            )
        return copy.deepcopy(module)

    @staticmethod
    def _tp_layer(module: TinyLayer, group: ProcessGroup, megatron_sp: bool) -> TinyLayer:
        attn, mlp = module.attn, module.mlp
        assert isinstance(attn, TinyAttention) and isinstance(mlp, TinyMLP)

        def bias(linear: nn.Linear) -> Tensor | None:
            return None if linear.bias is None else linear.bias.detach()

        p_attn = TensorParallelAttention(
            attn.q_proj.weight.detach(),
            attn.k_proj.weight.detach(),
            attn.v_proj.weight.detach(),
            attn.o_proj.weight.detach(),
            bias(attn.q_proj),
            bias(attn.k_proj),
            bias(attn.v_proj),
            bias(attn.o_proj),
            heads=attn.heads,
            kv_heads=attn.kv_heads,
            group=group,
            sequence_parallel=megatron_sp,
            rotary=copy.deepcopy(attn.rotary),
        )
        ups, down, activation = mlp.up_and_down()
        p_mlp = TensorParallelMLP(
            [u.weight.detach() for u in ups],
            [bias(u) for u in ups],
            down.weight.detach(),
            bias(down),
            activation,
            group=group,
            sequence_parallel=megatron_sp,
            names=mlp.projection_names(),
        )
        if megatron_sp:
            norm1, norm2 = sequence_parallel_norm(module.norm1, group), sequence_parallel_norm(module.norm2, group)
        else:
            norm1, norm2 = copy.deepcopy(module.norm1), copy.deepcopy(module.norm2)
        return TinyLayer(norm1, p_attn, norm2, p_mlp)

    @staticmethod
    def _ulysses_layer(module: TinyLayer, group: ProcessGroup | None) -> TinyLayer:
        attn = module.attn
        assert isinstance(attn, TinyAttention)
        p_attn = UlyssesAttention(
            copy.deepcopy(attn.q_proj),
            copy.deepcopy(attn.k_proj),
            copy.deepcopy(attn.v_proj),
            copy.deepcopy(attn.o_proj),
            heads=attn.heads,
            kv_heads=attn.kv_heads,
            head_dim=attn.head_dim,
            group=group,
            rotary=copy.deepcopy(attn.rotary),
        )
        return TinyLayer(copy.deepcopy(module.norm1), p_attn, copy.deepcopy(module.norm2), copy.deepcopy(module.mlp))


# ---------------------------------------------------------------------------------------------------- factories
def _randomize_norms(model: nn.Module, generator: torch.Generator) -> None:
    """Non-trivial norm weights and biases, so that a wrongly handled norm parameter shows in the tests."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                if module.weight is not None:
                    module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=generator))
                bias: Tensor | None = getattr(module, "bias", None)  # nn.RMSNorm has no bias attribute
                if bias is not None:
                    bias.copy_(0.1 * torch.randn(bias.shape, generator=generator))


def _init_embeddings(embedding: TinyEmbedding, generator: torch.Generator) -> None:
    with torch.no_grad():
        for table in (embedding.wte, embedding.wpe):
            if table is not None:
                table.weight.copy_(0.5 * torch.randn(table.weight.shape, generator=generator))


def tiny_gpt(
    vocab_size: int = 128,
    hidden: int = 32,
    heads: int = 4,
    layers: int = 4,
    seq_len: int = 16,
    tie_embeddings: bool = True,
    ffn: int | None = None,
    seed: int = 0,
) -> LayeredModel:
    """GPT-2-like: learned positions (``seq_len`` of them), LayerNorm, GELU MLP (``ffn = 4*hidden``), biases."""
    ffn = 4 * hidden if ffn is None else ffn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        embedding = TinyEmbedding(nn.Embedding(vocab_size, hidden), nn.Embedding(seq_len, hidden))
        blocks: list[nn.Module] = [
            TinyLayer(
                nn.LayerNorm(hidden),
                TinyAttention(hidden, heads, heads, bias=True, rotary=False),
                nn.LayerNorm(hidden),
                TinyMLP(hidden, ffn, "gelu", bias=True),
            )
            for _ in range(layers)
        ]
        head = TinyHead(nn.LayerNorm(hidden), nn.Linear(hidden, vocab_size, bias=False))
    generator = torch.Generator().manual_seed(seed + 1)
    _init_embeddings(embedding, generator)
    for module in (*blocks, head):
        _randomize_norms(module, generator)
    if tie_embeddings:
        head.lm_head.weight = embedding.wte.weight
    return LayeredModel(
        embedding,
        blocks,
        head,
        ["decoder"] * layers,
        TinyParallelizer(heads, heads),
        name="tiny_gpt",
        constraints=uniform_constraints("tiny_gpt", "decoder", layers, heads, max_seq_length=seq_len),
        shared=embedding_ties(embedding, head),
    )


def tiny_llama(
    vocab_size: int = 128,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 4,
    seq_len: int = 16,
    ffn: int = 64,
    seed: int = 0,
) -> LayeredModel:
    """Llama-like: RoPE, RMSNorm, SwiGLU MLP, GQA (``kv_heads``), no biases, untied head.

    ``seq_len`` is informational (RoPE has no table); any sequence length works.
    """
    del seq_len
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        embedding = TinyEmbedding(nn.Embedding(vocab_size, hidden), None)
        blocks: list[nn.Module] = [
            TinyLayer(
                nn.RMSNorm(hidden, eps=1e-6),
                TinyAttention(hidden, heads, kv_heads, bias=False, rotary=True),
                nn.RMSNorm(hidden, eps=1e-6),
                TinyMLP(hidden, ffn, "swiglu", bias=False),
            )
            for _ in range(layers)
        ]
        head = TinyHead(nn.RMSNorm(hidden, eps=1e-6), nn.Linear(hidden, vocab_size, bias=False))
    generator = torch.Generator().manual_seed(seed + 1)
    _init_embeddings(embedding, generator)
    for module in (*blocks, head):
        _randomize_norms(module, generator)
    constraints = uniform_constraints("tiny_llama", "decoder", layers, heads, kv_heads)
    parallelizer = TinyParallelizer(heads, kv_heads)
    return LayeredModel(
        embedding, blocks, head, ["decoder"] * layers, parallelizer, name="tiny_llama", constraints=constraints
    )


def random_batch(
    vocab_size: int, batch: int = 4, seq_len: int = 16, seed: int = 0, ignore_last: bool = True
) -> tuple[Tensor, Tensor]:
    """``(input_ids, labels)`` of shape ``[batch, seq_len]``: random tokens, labels = next token (the last label is
    ``-100`` when ``ignore_last``, so the ignore path is exercised)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=generator)
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].clone()
    if ignore_last:
        labels[:, -1] = IGNORE_INDEX
    return input_ids, labels
