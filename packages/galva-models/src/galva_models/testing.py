"""The oracle of galva-models' tests: plain Hugging Face with torch AdamW in one process, and the same steps trained
by galva-hp under a plan, on galva-hp's oracle batches (:mod:`galva_hp.testing.oracle`) for a causal LM, or on the
task's random batches (:func:`task_batches`: masked tokens, images) with the task model's own loss."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from galva_hp import BuildOptions, GalvaOptimizer, build, reference_optimizer, train_step
from galva_hp.model import LayeredModel
from galva_hp.testing.oracle import BATCH, OPTIM, SEQ, STEPS, batch
from galva_schema import Strategy

__all__ = [
    "hugging_face_run",
    "hugging_face_task_run",
    "max_relative",
    "plan_run",
    "shared_references",
    "task_batches",
]

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


def hugging_face_run(
    model: Any, steps: int = STEPS, seq: int = SEQ, micro_batches: int = 1
) -> tuple[list[float], list[float]]:
    """Losses and gradient norms of ``steps`` fp32 AdamW steps of a causal LM on its own shifted loss (batches of
    ``seq`` tokens), each step accumulating ``micro_batches`` equal micro-batches (their mean loss: a mixture of
    experts' router loss is one statistic per micro-batch, as Hugging Face takes it per forward)."""
    ids, _ = batch(seq=seq)

    def step(index: int) -> float:
        loss = 0.0
        for part in ids[index].chunk(micro_batches):
            # Hugging Face shifts the labels itself; its loss includes the router loss where the config asks
            part_loss = model(input_ids=part, labels=part).loss / micro_batches
            part_loss.backward()
            loss += part_loss.item()
        return loss

    return _reference_steps(model, step, steps)


def task_batches(config: Any, task: str, seq: int = SEQ, steps: int = STEPS) -> list[tuple[Tensor, Tensor]]:
    """``steps`` global batches ``(inputs, labels)`` of galva-train's random source for a masked LM (``seq`` tokens,
    mask token 3) or an image classifier (the config's images)."""
    from galva_models.data import RandomImageSource, RandomMaskedTokenSource

    source: Any
    if task == "masked_lm":
        source = RandomMaskedTokenSource(config.vocab_size, seq, BATCH, mask_token_id=3, seed=5)
    elif task == "image_classification":
        source = RandomImageSource(config.image_size, config.num_channels, config.num_labels, BATCH, seed=5)
    else:
        raise ValueError(f"task_batches: no random batches for task {task!r}")
    return [(b.inputs, b.labels) for b in (source.batch(step) for step in range(steps))]


def hugging_face_task_run(model: Any, batches: list[tuple[Tensor, Tensor]]) -> tuple[list[float], list[float]]:
    """Losses and gradient norms of fp32 AdamW steps of a task model on its own loss, one step per batch (token
    inputs as ``input_ids``, floating inputs as ``pixel_values``)."""

    def step(index: int) -> float:
        inputs, labels = batches[index]
        keyword = "pixel_values" if inputs.is_floating_point() else "input_ids"
        loss = model(**{keyword: inputs}, labels=labels).loss
        loss.backward()
        return float(loss.item())

    return _reference_steps(model, step, len(batches))


def _reference_steps(model: Any, step: Callable[[int], float], steps: int) -> tuple[list[float], list[float]]:
    """``steps`` fp32 AdamW steps with the oracle's schedule and clipping; ``step(i)`` runs step ``i``'s forward and
    backward and returns its loss."""
    params = list(model.parameters())
    optimizer, scheduler = reference_optimizer(params, OPTIM)
    losses, norms = [], []
    for index in range(steps):
        optimizer.zero_grad()
        losses.append(step(index))
        max_norm = float("inf") if OPTIM.max_grad_norm is None else OPTIM.max_grad_norm
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        optimizer.step()
        scheduler.step()
    return losses, norms


def plan_run(
    layered: LayeredModel,
    strategy: Strategy,
    steps: int = STEPS,
    batches: list[tuple[Tensor, Tensor]] | None = None,
    seq_len: int | None = SEQ,
) -> tuple[list[float], list[float]]:
    """The same steps trained by galva-hp under ``strategy`` (collective: every rank calls it), on galva-hp's oracle
    batches of ``seq_len`` tokens or on ``batches`` (one step each)."""
    built = build(layered, strategy, BuildOptions(seq_len=seq_len))
    optimizer = GalvaOptimizer(built.param_records(), OPTIM)
    if batches is None:
        ids, labels = batch(seq=seq_len or SEQ)
        batches = [(ids[step], labels[step]) for step in range(steps)]
    losses: list[float] = []
    norms: list[float] = []
    for inputs, labels in batches:
        metrics = train_step(built, optimizer, inputs, labels)
        losses.append(metrics.loss)
        norms.append(float("nan") if metrics.grad_norm is None else metrics.grad_norm)
    return losses, norms


def max_relative(actual: list[float], expected: list[float]) -> float:
    """The largest relative difference of two per-step series."""
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(actual, expected, strict=True))


def shared_references(keys: Sequence[K], compute: Callable[[K], R]) -> dict[K, R]:
    """Every key's single-process reference, each run by one rank and then known to every rank (collective: every
    rank calls it with the same keys). Rank ``r`` runs keys ``r``, ``r + world``, ...: the ranks of a test launch
    share the references' work, all at once, instead of one rank running them all while the others wait for it in
    the plan's first collective. ``compute`` must give the same result on any rank (a seeded model, fixed batches)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {key: compute(key) for index, key in enumerate(keys) if index % world == rank}
    parts: list[dict[K, R] | None] = [None] * world
    dist.all_gather_object(parts, mine)
    return {key: value for part in parts if part is not None for key, value in part.items()}
