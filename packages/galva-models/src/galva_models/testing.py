"""The causal-LM oracle of galva-models' tests: plain Hugging Face with torch AdamW in one process, and the same
steps trained by galva-hp under a plan, on galva-hp's oracle batches (:mod:`galva_hp.testing.oracle`)."""

from __future__ import annotations

from typing import Any

import torch

from galva_hp import BuildOptions, GalvaOptimizer, build, reference_optimizer, train_step
from galva_hp.model import LayeredModel
from galva_hp.testing.oracle import OPTIM, SEQ, STEPS, batch
from galva_schema import Strategy

__all__ = ["hugging_face_run", "max_relative", "plan_run"]


def hugging_face_run(model: Any, steps: int = STEPS, micro_batches: int = 1) -> tuple[list[float], list[float]]:
    """Losses and gradient norms of ``steps`` fp32 AdamW steps of a causal LM on its own shifted loss, each step
    accumulating ``micro_batches`` equal micro-batches (their mean loss: a mixture of experts' router loss is one
    statistic per micro-batch, as Hugging Face takes it per forward)."""
    params = list(model.parameters())
    optimizer, scheduler = reference_optimizer(params, OPTIM)
    ids, _ = batch()
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad()
        loss = torch.zeros(())
        for part in ids[step].chunk(micro_batches):
            # Hugging Face shifts the labels itself; its loss includes the router loss where the config asks
            part_loss = model(input_ids=part, labels=part).loss / micro_batches
            part_loss.backward()
            loss = loss + part_loss.detach()
        max_norm = float("inf") if OPTIM.max_grad_norm is None else OPTIM.max_grad_norm
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, norms


def plan_run(layered: LayeredModel, strategy: Strategy, steps: int = STEPS) -> tuple[list[float], list[float]]:
    """The same steps trained by galva-hp under ``strategy`` (collective: every rank calls it)."""
    built = build(layered, strategy, BuildOptions(seq_len=SEQ))
    optimizer = GalvaOptimizer(built.param_records(), OPTIM)
    ids, labels = batch()
    losses: list[float] = []
    norms: list[float] = []
    for step in range(steps):
        metrics = train_step(built, optimizer, ids[step], labels[step])
        losses.append(metrics.loss)
        norms.append(float("nan") if metrics.grad_norm is None else metrics.grad_norm)
    return losses, norms


def max_relative(actual: list[float], expected: list[float]) -> float:
    """The largest relative difference of two per-step series."""
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(actual, expected, strict=True))
