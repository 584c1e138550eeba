"""Building: plans that cannot run are rejected before any process group exists; deferred (meta) init
materialises only this rank's shards; zero3 holds about 1/dp of the parameters per rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from galva_comm.testing import run_distributed
from galva_hp import BuildOptions, GalvaOptimizer, build, check_plan, train_step
from galva_hp.testing.models import tiny_gpt
from galva_hp.testing.oracle import OPTIM, SEQ, VOCAB, batch
from galva_schema import SchemaError, Strategy


def plan(layers=None, world_size=4, **fields) -> Strategy:
    fields.setdefault("global_batch_size", 8)
    fields.setdefault("mixed_precision", "fp32")
    if isinstance(layers, dict) or layers is None:
        layers = [layers or {}] * 4
    return Strategy.model_validate({"world_size": world_size, "layers": layers, **fields})


BAD = {
    "heads": (plan([{}, {}, {"tp": 4}, {}]), 2, SEQ, "layers[2].tp: tp 4 does not divide the 2 attention heads"),
    "layer count": (plan([{}] * 3), 4, SEQ, "layers: the strategy has 3 layers but tiny_gpt has 4"),
    "sequence": (
        plan({"tp": 4, "ulysses": True}),
        4,
        6,
        "layers[0..3].tp: Ulysses degree 4 does not divide the sequence of 6 tokens",
    ),
    "megatron-sp vocab": (
        plan(vocab={"tp": 4}, megatron_sp=True),
        4,
        6,
        "vocab.tp: Megatron-SP degree 4 does not divide the sequence of 6 tokens",
    ),
    "world": (plan(world_size=2), 4, SEQ, "world_size: the strategy has 2 ranks but the run has 4"),
}


def try_bad(rank: int, world_size: int) -> dict[str, tuple[str, int]]:
    from torch.distributed.distributed_c10d import _world

    out = {}
    for name, (strategy, heads, seq_len, _) in BAD.items():
        model = tiny_gpt(vocab_size=VOCAB, heads=heads, seq_len=16)
        before = _world.group_count
        try:
            build(model, strategy, BuildOptions(seq_len=seq_len))
            out[name] = ("built", 0)
        except SchemaError as error:
            out[name] = (str(error), _world.group_count - before)
    return out


@pytest.mark.distributed
def test_rejected_before_any_group() -> None:
    results = run_distributed(try_bad, 4, timeout=120)[0]
    for name, (message, created) in results.items():
        expected = BAD[name][3]
        assert expected in message, (name, message)
        assert "\n" not in message
        assert created == 0, (name, created)


def test_check_plan_without_torch_distributed() -> None:
    with pytest.raises(SchemaError, match=r"layers\[2\]\.tp: tp 4 does not divide the 2 attention heads"):
        check_plan(tiny_gpt(vocab_size=VOCAB, heads=2), plan([{}, {}, {"tp": 4}, {}]))


def meta_model():
    with torch.device("meta"):
        return tiny_gpt(vocab_size=VOCAB, seq_len=SEQ, hidden=64, heads=4)


def init_like_eager(name: str, module: nn.Module) -> None:
    """Deterministic per-module init used by the meta run and the eager run alike."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    for pname, p in sorted(module.named_parameters()):
        p.copy_(0.02 * torch.randn(p.shape, generator=g) + (1.0 if pname.endswith("norm1.weight") else 0.0))


def deferred(rank: int, world_size: int) -> dict[str, float]:
    strategy = plan(default_dp_type="zero3")
    model_bytes = sum(
        p.numel() * p.element_size() for m in (meta_model().embedding, *meta_model().layers) for p in m.parameters()
    )
    # meta build: only shards are allocated
    materialised: list[int] = []

    def init_fn(name: str, module: nn.Module) -> None:
        materialised.append(sum(p.numel() * p.element_size() for p in module.parameters()))
        init_like_eager(name, module)

    source = meta_model()
    built = build(source, strategy, BuildOptions(seq_len=SEQ, init_fn=init_fn))
    released = all(p.is_meta for p in (*source.embedding.parameters(), *source.head.parameters()))
    released = released and all(p.is_meta for layer in source.layers for p in layer.parameters())
    local_bytes = sum(r.param.to_local().numel() * 4 for r in built.param_records() if hasattr(r.param, "to_local"))
    materialised_full = any(
        (r.param.full_tensor() if hasattr(r.param, "full_tensor") else r.param).is_meta for r in built.param_records()
    )
    # an eager model with the same per-module init trains to the same losses
    eager = tiny_gpt(vocab_size=VOCAB, seq_len=SEQ, hidden=64, heads=4)
    with torch.no_grad():  # head first: its tied weight is the embedding's, which the embedding's init then sets
        init_like_eager("head", eager.head)
        for i, layer in enumerate(eager.layers):
            init_like_eager(f"layers.{i}", layer)
        init_like_eager("embedding", eager.embedding)
    built_eager = build(eager, strategy, BuildOptions(seq_len=SEQ))
    ids, labels = batch(0)
    opt_meta = GalvaOptimizer(built.param_records(), OPTIM)
    opt_eager = GalvaOptimizer(built_eager.param_records(), OPTIM)
    diff = 0.0
    for step in range(2):
        a = train_step(built, opt_meta, ids[step], labels[step]).loss
        b = train_step(built_eager, opt_eager, ids[step], labels[step]).loss
        diff = max(diff, abs(a - b) / b)
    totals = torch.tensor([float(local_bytes)])
    dist.all_reduce(totals)
    return {
        "largest_materialised_mib": max(materialised) / 2**20,
        "materialised_modules": len(materialised),
        "released": float(released),
        "local_mib": local_bytes / 2**20,
        "model_mib": model_bytes / 2**20,
        "sum_mib": float(totals[0]) / 2**20,
        "loss_diff": diff,
        "meta_left": float(materialised_full),
    }


@pytest.mark.distributed
def test_meta_init_zero3_holds_a_quarter() -> None:
    results = run_distributed(deferred, 4, timeout=120)
    for r in results:
        assert r["meta_left"] == 0.0
        assert r["loss_diff"] < 1e-6, r
        # each rank holds ~1/4 of the parameters (shards are even up to padding of uneven first dims)
        assert r["local_mib"] <= 1.1 * r["sum_mib"] / 4, r
        # one module at a time was given real storage, never the whole model
        assert r["largest_materialised_mib"] < 0.5 * r["model_mib"], r
        assert r["materialised_modules"] == 6, r  # embedding, 4 layers, head: this rank's (only) stage
        assert r["released"] == 1.0, r  # and the single-process copies went back to meta after conversion
    assert abs(results[0]["sum_mib"] - results[0]["model_mib"]) / results[0]["model_mib"] < 0.05
