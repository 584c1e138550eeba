"""Parallel-form helpers of the families that still have adapter classes (Swin, T5), built from galva-hp's
building blocks (:mod:`galva_hp.parallel`). Every form is built from *copies* of the single-process weights (this
rank's shards), so it computes the same function; the single-process module is left untouched. (The families run
from tables are parallelized in place instead: :mod:`galva_models.tables`.)
"""

from __future__ import annotations

import copy
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
