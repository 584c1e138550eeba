"""Parallel forms shared by the decoder families, built from galva-hp's building blocks (:mod:`galva_hp.parallel`).

A pre-LN transformer layer ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))`` takes one of three forms:

- tensor parallel (``ctx.tp_size > 1``): megatron column/row-parallel attention and MLP
  (:class:`~galva_hp.parallel.tensor_parallel.TensorParallelAttention` / ``TensorParallelMLP``), with Megatron-SP
  when ``ctx.megatron_sp`` (norms on the local sequence slice, gradient summed over the tp group);
- Ulysses (``ctx.sp_size > 1``): replicated weights on the local sequence slice, all-to-all around attention
  (:class:`~galva_hp.parallel.ulysses.UlyssesAttention`);
- single rank: the module unchanged.

The encoder families (BERT, ViT) use the same galva-hp attention blocks with ``causal=False``
(:func:`encoder_attention_form`).

Every parallel form is built from *copies* of the single-process weights (this rank's shards), so it computes
the same function; the single-process module is left untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.model import ParallelContext


def tp_group(ctx: ParallelContext) -> ProcessGroup:
    """The tensor-parallel group of a context that has one (tp > 1)."""
    if ctx.tp_group is None:
        raise ValueError("this parallel form needs a tensor-parallel group (tp > 1)")
    return ctx.tp_group


class ImageVocabForms:
    """The vocabulary-layer forms of the image-classification families (ViT, Swin), whose embedding is a patch
    embedding (no vocabulary: replicated, and under Megatron-SP sequence-split so the first layer gets its slice) and
    whose head is a :class:`~galva_models.adapters.modules.ClassifierHead` (under vocab tp: the classifier split over
    the labels with galva-hp's vocab-parallel cross-entropy). Vocabulary sp has no form: the head scores one label
    per image, not per token."""

    def embedding(self, module: Any, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size > 1:
            from galva_hp.parallel.vocab import SequenceSplitEmbedding

            return SequenceSplitEmbedding(copy.deepcopy(module), ctx.tp_group, sequence_parallel=ctx.megatron_sp)
        return module

    def head(self, module: Any, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size > 1:
            from galva_hp.parallel.vocab import VocabParallelClassifier

            classifier = module.classifier
            return VocabParallelClassifier(
                module.norm, classifier.weight, classifier.bias, ctx.tp_group, ctx.megatron_sp, pool=module.pool
            )
        return module


StateRename = Callable[[dict[str, Tensor]], dict[str, Tensor]]
"""Turns a parallel layer's gathered state (``norm1.*``, ``attn.*``, ``norm2.*``, ``mlp.*``) into the
single-process layer's parameter names and layouts."""


class _Gathered(nn.Module):
    """Mixin: ``gather_full(grads)`` = the parts' gathered state under the single-process layer's names, so galva-hp's
    ``gather_full_state`` (checkpoints, tests) sees the same names as ``LayeredModel`` and the HF name map."""

    rename: StateRename | None

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        from galva_hp.parallel.tensor_parallel import gather_full_state

        parts: dict[str, Tensor] = {}
        for name, child in self.named_children():
            parts.update(gather_full_state(child, grads, f"{name}."))
        return self.rename(parts) if self.rename is not None else parts


class PreNormLayer(_Gathered):
    """``x + drop1(attn(norm1(x)))`` then ``x + drop2(mlp(norm2(x)))`` in whatever layout the parts use."""

    def __init__(
        self,
        norm1: nn.Module,
        attn: nn.Module,
        norm2: nn.Module,
        mlp: nn.Module,
        drop1: nn.Module | None = None,
        drop2: nn.Module | None = None,
        rename: StateRename | None = None,
    ) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp
        self.drop1 = drop1 if drop1 is not None else nn.Identity()
        self.drop2 = drop2 if drop2 is not None else nn.Identity()
        self.rename = rename

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop1(self.attn(self.norm1(x)))
        return x + self.drop2(self.mlp(self.norm2(x)))


def layer_norm_form(norm: nn.Module, ctx: ParallelContext) -> nn.Module:
    """A norm's copy for the layer's layout: Megatron-SP norms sum their gradient over the tp group."""
    if ctx.sequence_parallel_tp:
        from galva_hp.parallel.tensor_parallel import sequence_parallel_norm

        return sequence_parallel_norm(norm, ctx.tp_group)
    return copy.deepcopy(norm)


def dropout_form(drop: nn.Module, ctx: ParallelContext) -> nn.Module:
    """A boundary (hidden / residual / embedding) dropout's copy for the module's layout. Where the activation is
    replicated (plain tp) it is a copy: every rank draws the same mask from the global RNG. Where it is a sequence
    slice (Megatron-SP over tp, Ulysses or vocabulary sp over the sp group) each rank draws its own mask
    (:class:`galva_hp.parallel.rng.ShardedDropout`)."""
    p = float(getattr(drop, "p", 0.0))
    group = ctx.sp_group if ctx.sp_size > 1 else ctx.tp_group if ctx.sequence_parallel_tp else None
    if group is None or p == 0.0:
        return copy.deepcopy(drop)
    from galva_hp.parallel.rng import ShardedDropout

    return ShardedDropout(p, group)


def linear_from(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding copies of ``weight`` (``[out, in]``) and ``bias``."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def encoder_attention_form(
    weights: tuple[Tensor, Tensor, Tensor, Tensor],
    biases: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    heads: int,
    ctx: ParallelContext,
    dropout: float = 0.0,
) -> nn.Module:
    """The bidirectional attention (BERT, ViT) for a tp or Ulysses context: galva-hp's ``TensorParallelAttention`` /
    ``UlyssesAttention`` with ``causal=False`` (weights in ``nn.Linear`` layout, copied) and attention-probability
    ``dropout``. Either way its gathered state is ``q_proj / k_proj / v_proj / o_proj`` weights and biases."""
    if ctx.sp_size > 1:
        from galva_hp.parallel.ulysses import UlyssesAttention

        projections = [linear_from(w, b) for w, b in zip(weights, biases)]
        return UlyssesAttention(
            *projections, heads=heads, kv_heads=heads, head_dim=weights[0].shape[0] // heads,
            group=ctx.sp_group, causal=False, dropout=dropout,
        )  # fmt: skip
    from galva_hp.parallel.tensor_parallel import TensorParallelAttention

    return TensorParallelAttention(
        *weights, *biases, heads=heads, kv_heads=heads, group=tp_group(ctx),
        sequence_parallel=ctx.megatron_sp, causal=False, dropout=dropout,
    )  # fmt: skip


class TwoLayerMLP(nn.Module):
    """``down(act(up(x)))`` with replicated weights (the Ulysses and degree-1 form)."""

    def __init__(self, up: nn.Linear, act: nn.Module, down: nn.Linear) -> None:
        super().__init__()
        self.up, self.act, self.down = up, act, down

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))


def mlp_form(up: Any, down: Any, act: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Two-matmul MLP ``down(act(up(x)))`` from ``nn.Linear``-layout weights (copied): Megatron column/row-parallel
    under tp, replicated otherwise. Either way its gathered state is ``up.weight, up.bias, down.weight, down.bias``."""
    if ctx.tp_size > 1:
        from galva_hp.parallel.tensor_parallel import TensorParallelMLP

        return TensorParallelMLP(
            [up.weight], [up.bias], down.weight, down.bias, copy.deepcopy(act),
            group=tp_group(ctx), sequence_parallel=ctx.megatron_sp, names=(["up"], "down"),
        )  # fmt: skip
    return TwoLayerMLP(copy.deepcopy(up), copy.deepcopy(act), copy.deepcopy(down))


class PostNormLayer(_Gathered):
    """BERT's post-LN layer: ``h = norm1(x + drop1(attn(x)))`` then ``norm2(h + drop2(mlp(h)))``."""

    def __init__(
        self,
        attn: nn.Module,
        norm1: nn.Module,
        mlp: nn.Module,
        norm2: nn.Module,
        drop1: nn.Module | None = None,
        drop2: nn.Module | None = None,
        rename: StateRename | None = None,
    ) -> None:
        super().__init__()
        self.attn, self.norm1, self.mlp, self.norm2 = attn, norm1, mlp, norm2
        self.drop1 = drop1 if drop1 is not None else nn.Identity()
        self.drop2 = drop2 if drop2 is not None else nn.Identity()
        self.rename = rename

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm1(x + self.drop1(self.attn(x)))
        return self.norm2(x + self.drop2(self.mlp(x)))


def renamer(prefixes: dict[str, str], transforms: dict[str, Callable[[Tensor], Tensor]] | None = None) -> StateRename:
    """A :data:`StateRename` that swaps name prefixes (first match wins) and transforms some results by full name."""
    transforms = transforms or {}

    def rename(parts: dict[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, tensor in parts.items():
            for old, new in prefixes.items():
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            out[name] = transforms[name](tensor) if name in transforms else tensor
        return out

    return rename
