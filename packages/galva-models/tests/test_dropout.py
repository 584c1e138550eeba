"""Dropout in the parallel forms (issue 12 item 5): stock GPT-2 and BERT dropout (0.1) under tp2 and pp2 x tp2.

- The random streams (galva_hp.parallel.rng): a dropout on an activation sharded over a group keeps ~90% of the
  elements with a different mask per rank; a dropout on a replicated activation draws the same mask on every rank;
  the global RNG stays in step across ranks; masks are reproducible from the seed and replayed by activation
  checkpointing (gradient == forward mask / (1 - p)).
- Training: 3 steps per plan with every dropout of the stock configs at 0.1, on 4 gloo ranks: finite, sane losses;
  the same seed and plan give bit-identical losses; dropout is really applied (losses differ from the dropout-0 run).
  The dropout-0 equality with single-process Hugging Face training within 1e-5 is tests/test_distributed.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from galva_comm.testing import run_distributed
from galva_hp import BuildOptions, GalvaOptimizer, build, train_step
from galva_hp.parallel.attention import attention
from galva_hp.parallel.rng import ShardedDropout, rank_stream
from galva_hp.testing.oracle import OPTIM, SEQ, batch
from galva_models.adapters import build_layered
from galva_models.presets import preset_config
from galva_schema import Strategy

P = 0.1


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def check_streams(rank: int, world_size: int) -> dict[str, float]:
    group = dist.new_group(list(range(world_size)))
    x = torch.ones(128, 256)
    res: dict[str, float] = {}

    torch.manual_seed(1234)
    sharded = ShardedDropout(P, group).train()(x)
    mask = (sharded != 0).float()
    res["kept"] = float(mask.mean())
    res["scale_ok"] = float(torch.allclose(sharded[sharded != 0], torch.full_like(sharded[sharded != 0], 1 / (1 - P))))
    masks = _gather(mask)
    res["sharded_agreement"] = float((masks[0] == masks[1]).float().mean())
    after = torch.rand(8)
    res["global_in_step"] = float(all(torch.equal(t, after) for t in _gather(after)))

    replicated = (nn.Dropout(P).train()(x) != 0).float()  # the copy a plain-tp region uses: the global stream
    res["replicated_kept"] = float(replicated.mean())
    res["replicated_equal"] = float(all(torch.equal(t, replicated) for t in _gather(replicated)))

    torch.manual_seed(1234)  # the same seed replays this rank's sharded mask
    res["reproducible"] = float(torch.equal((ShardedDropout(P, group).train()(x) != 0).float(), mask))

    # activation checkpointing recomputes with the same mask: the gradient is exactly the forward's mask / (1 - p)
    xg = torch.ones(64, 64, requires_grad=True)
    y = checkpoint(ShardedDropout(P, group).train(), xg, use_reentrant=False)
    y.sum().backward()
    assert xg.grad is not None
    res["checkpoint_replays"] = float(torch.equal(xg.grad, (y.detach() != 0).float() / (1 - P)))

    # attention-probability dropout on this rank's heads: identical inputs, a different mask per rank
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 16, 2, 8, generator=g) for _ in range(3))
    with rank_stream(group, q.device):
        out = attention(q, k, v, causal=True, dropout_p=P)
    outs = _gather(out)
    res["attention_heads_differ"] = float(not torch.equal(outs[0], outs[1]))
    res["attention_no_dropout_equal"] = float(
        torch.equal(attention(q, k, v, causal=True), F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2))
    )  # fmt: skip
    return res


@pytest.mark.distributed
def test_dropout_streams_across_tp_ranks():
    results = run_distributed(check_streams, 2, timeout=120)
    for rank, res in enumerate(results):
        assert abs(res["kept"] - (1 - P)) < 0.01, (rank, res)  # 32768 draws: std 0.0017
        assert abs(res["replicated_kept"] - (1 - P)) < 0.01, (rank, res)
        # independent masks agree on p^2 + (1-p)^2 = 82% of elements; identical ones on 100%
        assert abs(res["sharded_agreement"] - (P**2 + (1 - P) ** 2)) < 0.02, (rank, res)
        for key in ("scale_ok", "global_in_step", "replicated_equal", "reproducible", "checkpoint_replays"):
            assert res[key] == 1.0, (key, rank, res)
        assert res["attention_heads_differ"] == 1.0 and res["attention_no_dropout_equal"] == 1.0, (rank, res)


# ------------------------------------------------------------------------------------- training with dropout on
STEPS, ENC_SEQ = 3, 12


def _plan(layer: dict, **fields) -> dict:
    base = {"world_size": 4, "pp": 2, "global_batch_size": 8, "num_micro_batches": 2, "mixed_precision": "fp32"}
    return {**base, "layers": [layer], **fields}


PLANS = {
    "pp1-tp2-dp2": _plan({"tp": 2}, pp=1, vocab={"tp": 2}),
    "pp2-tp2-ckpt": _plan({"tp": 2, "checkpoint": True}, vocab={"tp": 2}),
    "pp2-tp2-megatron_sp": _plan({"tp": 2}, megatron_sp=True, vocab={"tp": 2}),
    "pp2-ulysses2-vsp2-ckpt": _plan({"tp": 2, "ulysses": True, "checkpoint": True}, vocab={"tp": 2, "sp": True}),
}
CASES = [(family, plan) for family in ("gpt2", "bert") for plan in PLANS]
# the other families' sharded dropouts: T5's FFN middle and heads under tp, ViT / Swin heads, Swin sequence slices
OTHER_CASES = [("t5", "pp2-tp2-ckpt"), ("vit", "pp2-tp2-ckpt"), ("swin", "pp2-ulysses2-vsp2-ckpt")]


def stock_config(family: str, p: float):
    """The tiny preset with the stock checkpoints' dropout: GPT-2 attn/resid/embd_pdrop, BERT hidden/attention."""
    config = preset_config(f"tiny-{family}")
    if family == "gpt2":
        config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = p
    elif family == "t5":
        config.dropout_rate = p
    else:
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = p
    return config


def _batches(family: str, config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from galva_models.cli.train import _Seq2SeqRandom
    from galva_models.data import RandomImageSource, RandomMaskedTokenSource

    if family == "gpt2":
        ids, labels = batch()
        return [(ids[s], labels[s]) for s in range(STEPS)]
    if family == "bert":
        source = RandomMaskedTokenSource(config.vocab_size, ENC_SEQ, 8, mask_token_id=3, seed=5)
    elif family == "t5":
        source = _Seq2SeqRandom(config, ENC_SEQ, 6, 8, seed=5)
    else:
        source = RandomImageSource(config.image_size, config.num_channels, config.num_labels, 8, seed=5)
    return [(b.inputs, b.labels) for b in (source.batch(s) for s in range(STEPS))]


def run_plan(family: str, plan: str, p: float, seed: int = 0) -> list[float]:
    torch.manual_seed(0)
    config = stock_config(family, p)
    _, layered = build_layered(config, **({"encoder_seq_length": ENC_SEQ} if family == "t5" else {}))
    fields = PLANS[plan]
    if family in ("t5", "vit", "swin"):
        fields = {key: value for key, value in fields.items() if key != "vocab"}  # vocab degree 1
    strategy = Strategy.model_validate({**fields, "layers": fields["layers"] * layered.num_layers})
    seq_len = {"gpt2": SEQ, "bert": ENC_SEQ}.get(family)
    built = build(layered, strategy, BuildOptions(seq_len=seq_len))
    optimizer = GalvaOptimizer(built.param_records(), OPTIM)
    torch.manual_seed(seed)  # the dropout streams start here, as galva-train seeds them
    losses = []
    for inputs, labels in _batches(family, config):
        losses.append(train_step(built, optimizer, inputs, labels).loss)
    return losses


def _vocab(family: str) -> int:
    return int(preset_config(f"tiny-{family}").vocab_size)


def train_with_dropout(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[str, list[list[float]]]:
    return {
        f"{family}/{plan}": [run_plan(family, plan, P), run_plan(family, plan, P), run_plan(family, plan, 0.0)]
        for family, plan in cases
    }


@pytest.mark.distributed
def test_stock_gpt2_and_bert_train_with_dropout_under_tp():
    results = run_distributed(train_with_dropout, 4, CASES, timeout=400)
    for case, (first, again, no_dropout) in results[0].items():
        vocab = _vocab(case.split("/")[0])
        assert all(math.isfinite(x) for x in first), (case, first)
        assert first == again, f"{case}: same seed and plan, different losses {first} vs {again}"
        assert first != no_dropout, f"{case}: dropout 0.1 gave the dropout-0 losses {first}"
        assert all(0.5 * math.log(vocab) < x < 1.5 * math.log(vocab) for x in first), (case, first)
        assert first[-1] < first[0] * 1.05, (case, first)
        for rank_result in results:  # every rank reports the same global loss
            assert rank_result[case][0] == first, case


@pytest.mark.distributed
def test_t5_vit_swin_train_with_dropout_in_sharded_regions():
    results = run_distributed(train_with_dropout, 4, OTHER_CASES, timeout=400)
    for case, (first, again, no_dropout) in results[0].items():
        assert all(math.isfinite(x) for x in first), (case, first)
        assert first == again, f"{case}: same seed and plan, different losses {first} vs {again}"
        assert first != no_dropout, f"{case}: dropout 0.1 gave the dropout-0 losses {first}"
        for rank_result in results:
            assert rank_result[case][0] == first, case
