"""The correctness oracle for runtime tests: single-process fp32 training and the comparison of a plan against it.

Used by the galva-hp matrix and by any model adapter that wants to prove a plan trains like one process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from galva_hp import (
    BuildOptions,
    GalvaOptimizer,
    HybridParallelModel,
    OptimConfig,
    build,
    reference_optimizer,
    train_step,
)
from galva_hp.model import LayeredModel
from galva_schema import Strategy
from galva_schema.vocabulary import EMBEDDING_MODULE, HEAD_MODULE, layer_of_module

SEQ, VOCAB, BATCH, STEPS = 16, 64, 8, 4
# eps=1e-5 rather than AdamW's usual 1e-8: Adam divides each gradient element by its own running magnitude, so with
# a tiny eps an element whose true gradient is zero (e.g. the attention key bias, which the softmax cancels exactly)
# would turn float rounding noise (~1e-9, different for every summation order) into an update of about lr. With
# eps=1e-5 that noise moves a parameter by ~1e-4 * lr, so every element of every parameter can be compared.
OPTIM = OptimConfig(lr=1e-3, eps=1e-5, warmup_steps=2, total_steps=8, weight_decay=0.01, max_grad_norm=1.0)


def batch(
    seed: int = 0, batch_size: int = BATCH, seq: int = SEQ, vocab: int = VOCAB
) -> tuple[torch.Tensor, torch.Tensor]:
    """``STEPS`` global batches ``[STEPS, batch, seq]`` of random tokens; labels = next token, last one ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (STEPS, batch_size, seq), generator=g)
    labels = torch.roll(ids, -1, dims=2)
    labels[:, :, -1] = -100  # the last position has no next token: it must not count
    return ids, labels


@dataclass
class Reference:
    losses: list[float]
    norms: list[float]
    model: LayeredModel  # trained weights


def reference_run(make_model: Callable[[], LayeredModel], seed: int = 0, optim: OptimConfig = OPTIM) -> Reference:
    """Single-process fp32 training on the same global batches: the oracle."""
    model = make_model()
    params = list(dict.fromkeys(p for m in (model.embedding, *model.layers, model.head) for p in m.parameters()))
    optimizer, scheduler = reference_optimizer(params, optim)
    ids, labels = batch(seed)
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model.reference_loss(ids[step], labels[step])
        loss.backward()
        max_norm = float("inf") if optim.max_grad_norm is None else optim.max_grad_norm
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return Reference(losses, norms, model)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def run_plan(
    make_model: Callable[[], LayeredModel],
    strategy: Strategy,
    ref: Reference,
    options: BuildOptions | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Train ``strategy`` for STEPS steps; return the max relative loss / norm difference and max parameter
    difference against the oracle (the same on every rank after a max all-reduce)."""
    model = make_model()
    built = build(model, strategy, options or BuildOptions(seq_len=SEQ))
    optimizer = GalvaOptimizer(built.param_records(), OPTIM)
    ids, labels = batch(seed)
    loss_diff = norm_diff = 0.0
    for step in range(STEPS):
        metrics = train_step(built, optimizer, ids[step], labels[step])
        loss_diff = max(loss_diff, rel(metrics.loss, ref.losses[step]))
        assert metrics.grad_norm is not None
        norm_diff = max(norm_diff, rel(metrics.grad_norm, ref.norms[step]))
    param_diff = compare_params(built, ref)
    result = torch.tensor([loss_diff, norm_diff, param_diff], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return {"loss": float(result[0]), "norm": float(result[1]), "param": float(result[2])}


def parallel_form(built: HybridParallelModel, model: LayeredModel) -> dict[str, torch.Tensor]:
    """``model``'s weights in the parallel form this rank holds: each module's parallelizer applied with the
    context the built model used (shards, fused projections, padded vocabulary), keyed like ``local_state``."""
    out: dict[str, torch.Tensor] = {}
    par = model.parallelizer
    for name, ctx in built.contexts.items():
        index = layer_of_module(name)
        if name == EMBEDDING_MODULE:
            module = par.embedding(copy.deepcopy(model.embedding), ctx)
        elif name == HEAD_MODULE:
            module = par.head(copy.deepcopy(model.head), ctx)
        else:
            assert index is not None
            module = par.layer(copy.deepcopy(model.layers[index]), model.layer_types[index], ctx)
        for pname, p in module.named_parameters():
            out[f"{name}.{pname}"] = p.detach().float()
    for weight in model.shared:
        for user in weight.held:  # held in place: the home's is the weight (one record)
            out.pop(f"{user}.{weight.path_in(user)}", None)
        if not weight.in_place:  # read through: held whole, outside its home layer's form, by the home stage
            out.pop(weight.record_name, None)
            if weight.home in built.contexts:
                out[weight.record_name] = weight.param.detach().float()
    return out


def compare_params(built: HybridParallelModel, ref: Reference) -> float:
    """Max difference between this rank's gathered parameters and the oracle's trained weights in the same
    parallel form, relative to each tensor's largest value; every element is compared."""
    state = built.local_state()
    expected = parallel_form(built, ref.model)
    assert set(state) == set(expected), (sorted(state), sorted(expected))
    diff = 0.0
    for key, value in state.items():
        target = expected[key]
        scale = max(float(target.abs().max()), 1e-3)
        diff = max(diff, float((value.float() - target).abs().max()) / scale)
    return diff
