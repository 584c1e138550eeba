"""The tiny test models, and whole models built from their parallel forms, against the single-process oracle.

Whole-model checks: the mean token loss and every weight gradient (shards gathered, partial gradients summed over
the groups the runtime's data-parallel step would sum them over) equal ``reference_loss`` and its gradients.
Tolerance: relative 1e-5 (fp32), plus an absolute 1e-6 (norm) for the key-bias gradients, which are exactly zero
(softmax ignores key biases) so only rounding noise is compared.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from galva_comm.groups import ProcessGroupCache
from galva_comm.layout import data_parallel_groups, model_parallel_groups
from galva_comm.shards import ShardLayout, redistribution_plan
from galva_comm.testing import run_distributed
from galva_hp.batch import shard_for
from galva_hp.model import LayeredModel, ParallelContext
from galva_hp.parallel.mappings import all_reduce_sum
from galva_hp.parallel.redistribute import Redistribute, plan_groups
from galva_hp.parallel.tensor_parallel import gather_full_state
from galva_hp.testing.compare import assert_rel_close, assert_states_close
from galva_hp.testing.models import random_batch, tiny_gpt, tiny_llama

TOL = 1e-5
ZERO_GRAD_ATOL = 1e-6


def _build(family: str, seed: int = 0) -> LayeredModel:
    return tiny_gpt(seed=seed) if family == "gpt" else tiny_llama(seed=seed)


def _modules(model: LayeredModel) -> list[tuple[str, nn.Module]]:
    return [("embedding", model.embedding)] + [(f"layers.{i}", m) for i, m in enumerate(model.layers)] + [
        ("head", model.head)
    ]


def _reference_grads(model: LayeredModel, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, dict]:
    loss = model.reference_loss(ids, labels)
    loss.backward()
    grads = {}
    for prefix, module in _modules(model):
        for name, p in module.named_parameters(remove_duplicate=False):
            grads[f"{prefix}.{name}"] = p.grad.detach().clone()
    return loss.item(), grads


def _tie(grads: dict[str, torch.Tensor], model: LayeredModel) -> dict[str, torch.Tensor]:
    """Tied weights: both names carry the sum of both gradients (what the runtime's tie step produces)."""
    grads = dict(grads)
    for weight in model.shared:
        names = [f"{m}.{weight.path_in(m)}" for m in (weight.home, *weight.held)]
        total = sum(grads[n] for n in names)
        grads.update(dict.fromkeys(names, total))
    return grads


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_tiny_model_is_deterministic_and_trains(family: str) -> None:
    one, two, other = _build(family, 1), _build(family, 1), _build(family, 2)
    for (_, a), (_, b), (_, c) in zip(_modules(one), _modules(two), _modules(other)):
        for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
            assert torch.equal(pa, pb), name
            assert not torch.equal(pa, pc), name
    ids, labels = random_batch(128, batch=2, seq_len=16, seed=3)
    loss = one.reference_loss(ids, labels)
    assert math.isfinite(loss.item()) and 2.0 < loss.item() < 20.0
    loss.backward()
    assert all(p.grad is not None for _, m in _modules(one) for p in m.parameters())
    if family == "gpt":
        (tie,) = one.shared
        assert (tie.home, tie.path, tie.held) == ("embedding", "wte.weight", {"head": "lm_head.weight"})
        assert one.head.lm_head.weight is one.embedding.wte.weight is tie.param
    else:
        assert one.shared == [] and one.layers[0].attn.kv_heads == 2


# -------------------------------------------------------------------------- whole models in one uniform layout
def _uniform(rank: int, world_size: int, family: str, mode: str) -> float:
    model = _build(family, seed=6)
    ids, labels = random_batch(128, batch=2, seq_len=16, seed=8)
    ref_loss, ref_grads = _reference_grads(_build(family, seed=6), ids, labels)
    world = dist.group.WORLD
    if mode == "ulysses":  # Ulysses layers with a vocab-sp embedding and head: the sequence stays sharded
        layer_ctx = ParallelContext(sp_group=world)
        vocab_ctx = ParallelContext(sp_group=world, vocab_sp=True)
    else:
        layer_ctx = vocab_ctx = ParallelContext(tp_group=world, megatron_sp=mode == "tp_sp")
    emb = model.parallelizer.embedding(model.embedding, vocab_ctx)
    layers = [model.parallelizer.layer(m, t, layer_ctx) for m, t in zip(model.layers, model.layer_types)]
    head = model.parallelizer.head(model.head, vocab_ctx)
    split = mode == "ulysses"
    local_ids = ids.chunk(world_size, 1)[rank] if split else ids
    local_labels = labels.chunk(world_size, 1)[rank] if split or mode == "tp_sp" else labels
    hidden = emb(local_ids)
    for layer in layers:
        hidden = layer(hidden)
    loss_sum, count = head(hidden, local_labels)
    total = all_reduce_sum(count, world)
    (loss_sum / total).backward()
    loss = float(all_reduce_sum(loss_sum.detach(), world) / total)
    grads = {}
    for prefix, module in [("embedding", emb), *[(f"layers.{i}", m) for i, m in enumerate(layers)], ("head", head)]:
        for name, g in gather_full_state(module, grads=True).items():
            grads[f"{prefix}.{name}"] = all_reduce_sum(g, world) if mode == "ulysses" else g
    assert_rel_close(torch.tensor(loss), torch.tensor(ref_loss), TOL, f"{family} {mode} loss")
    assert_states_close(_tie(grads, model), ref_grads, TOL, f"{family} {mode} rank {rank} grads", ZERO_GRAD_ATOL)
    return loss


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["tp", "tp_sp", "ulysses"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_whole_model_in_one_layout_equals_reference(family: str, mode: str) -> None:
    losses = run_distributed(_uniform, 2, family, mode, timeout=120)
    assert losses[0] == losses[1]


# ------------------------------------------------------------------- mixed layouts joined by redistribution
STAGE = (0, 1, 2, 3)
# (kind, degree, consecutive, megatron_sp) per module: embedding, 4 layers, head
MIXED = [
    ("tp", 2, True, False),  # vocab tp 2, batch split in 2
    ("ulysses", 4, True, None),  # Ulysses over the whole stage
    ("tp", 2, False, True),  # strided tp 2 + Megatron-SP
    ("tp", 4, True, False),  # tp 4, replicated activations
    ("tp", 1, True, False),  # pure data parallel (batch split in 4)
    ("ulysses", 2, True, None),  # vocab sp 2 head
]


def _layout(kind: str, degree: int, consecutive: bool, megatron_sp: bool | None) -> ShardLayout:
    seq_sharded = kind == "ulysses" or (bool(megatron_sp) and degree > 1)
    return ShardLayout(STAGE, degree, consecutive, seq_sharded)


def _mixed(rank: int, world_size: int, family: str) -> float:
    model = _build(family, seed=9)
    ids, labels = random_batch(128, batch=4, seq_len=16, seed=10)
    ref_loss, ref_grads = _reference_grads(_build(family, seed=9), ids, labels)
    layouts = [_layout(*spec) for spec in MIXED]
    plans = [redistribution_plan(a, b) for a, b in itertools.pairwise(layouts)]
    cache = ProcessGroupCache()
    needed = set(plan_groups(plans))
    for _, degree, consecutive, _ in MIXED:
        needed.update(model_parallel_groups(STAGE, degree, consecutive))
        needed.update(data_parallel_groups(STAGE, degree, consecutive))
    needed.add(STAGE)
    cache.create(sorted((g for g in needed if len(g) > 1), key=lambda g: (len(g), g)))

    def group_of(groups: list[tuple[int, ...]]):
        mine = next(g for g in groups if rank in g)
        return None if len(mine) == 1 else cache.get(mine)

    contexts, reduce_over = [], []
    for kind, degree, consecutive, megatron_sp in MIXED:
        mp = group_of(model_parallel_groups(STAGE, degree, consecutive))
        if kind == "ulysses":
            contexts.append(ParallelContext(sp_group=mp, vocab_sp=True))
            reduce_over.append(cache.get(STAGE))  # replicated weights, tokens spread over the whole stage
        else:
            contexts.append(ParallelContext(tp_group=mp, megatron_sp=bool(megatron_sp)))
            reduce_over.append(group_of(data_parallel_groups(STAGE, degree, consecutive)))
    p = model.parallelizer
    modules = [p.embedding(model.embedding, contexts[0])]
    modules += [p.layer(m, "decoder", ctx) for m, ctx in zip(model.layers, contexts[1:-1])]
    modules.append(p.head(model.head, contexts[-1]))
    # the embedding's input is the full sequence unless it is vocab sp; labels come in the head's layout
    emb_ids = shard_for(ids, ShardLayout(STAGE, MIXED[0][1], MIXED[0][2], MIXED[0][0] == "ulysses"), rank, True)
    hidden = modules[0](emb_ids)
    for plan, module in zip(plans[:-1], modules[1:-1]):
        hidden = module(Redistribute(plan, rank, cache)(hidden))
    hidden = Redistribute(plans[-1], rank, cache)(hidden)
    loss_sum, count = modules[-1](hidden, shard_for(labels, layouts[-1], rank, True))
    world = dist.group.WORLD
    total = all_reduce_sum(count, world)
    (loss_sum / total).backward()
    loss = float(all_reduce_sum(loss_sum.detach(), world) / total)
    grads = {}
    names = ["embedding", *[f"layers.{i}" for i in range(len(model.layers))], "head"]
    for prefix, module, group in zip(names, modules, reduce_over):
        for name, g in gather_full_state(module, grads=True).items():
            grads[f"{prefix}.{name}"] = all_reduce_sum(g, group)
    assert_rel_close(torch.tensor(loss), torch.tensor(ref_loss), TOL, f"{family} mixed loss")
    assert_states_close(_tie(grads, model), ref_grads, TOL, f"{family} mixed rank {rank} grads", ZERO_GRAD_ATOL)
    return loss


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_mixed_layouts_joined_by_redistribution_equal_reference(family: str) -> None:
    losses = run_distributed(_mixed, 4, family, timeout=120)
    assert len(set(losses)) == 1


def test_plan_problems_name_the_layer_before_any_group_exists() -> None:
    from galva_schema import Strategy, plan_problems

    def strategy(layers: list[dict]) -> Strategy:
        return Strategy.model_validate(
            {"world_size": 8, "global_batch_size": 8, "mixed_precision": "fp32", "layers": layers}
        )

    llama = tiny_llama(heads=4, kv_heads=4)
    ok = strategy([{"tp": 4}, {"tp": 2, "ulysses": True}, {"tp": 1}, {"tp": 2}])
    assert plan_problems(ok, llama.constraints, seq_len=16) == []
    bad = strategy([{"tp": 8}, {"tp": 8, "ulysses": True}, {"tp": 1}, {"tp": 8}])
    assert plan_problems(bad, llama.constraints, seq_len=16) == [
        "layers[0,3].tp: tp 8 does not divide the 4 attention heads of decoder layers",
        "layers[1].tp: Ulysses degree 8 does not divide the 4 attention heads of decoder layers",
    ]
    gqa = tiny_llama(heads=12, kv_heads=3, hidden=48)
    odd = strategy([{"tp": 2}, {"tp": 4}, {"tp": 1}, {"tp": 1}])
    assert plan_problems(odd, gqa.constraints, seq_len=16) == [
        "layers[0].tp: tp 2 and the 3 key/value heads of decoder layers do not divide one another",
        "layers[1].tp: tp 4 and the 3 key/value heads of decoder layers do not divide one another",
    ]
    assert plan_problems(strategy([{}] * 4), tiny_gpt(seq_len=16).constraints, seq_len=32) == [
        "seq_len: 32 exceeds the model's 16 learned positions"
    ]
