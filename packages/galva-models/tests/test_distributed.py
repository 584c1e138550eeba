"""Hybrid plans on 4 gloo ranks train like single-process Hugging Face training.

Per family: the tiny preset under plans that use pp2 with tp2 (Megatron, with and without Megatron-SP) or Ulysses
sp2, activation checkpointing on every layer, and vocabulary tp or sp. Oracle: the Hugging Face model itself
(``model(input_ids, labels=input_ids).loss``, its own shifted loss), fp32 AdamW with the same schedule and
clipping. Tolerance: 1e-5 relative on every step's loss (step 1 = the forward loss of the initial weights) and on
every step's gradient norm, over 3 steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

from galva_comm.testing import run_distributed
from galva_hp import BuildOptions, GalvaOptimizer, build, reference_optimizer, train_step
from galva_hp.testing.oracle import OPTIM, SEQ
from galva_models import build_layered
from galva_models.presets import preset_config
from galva_models.testing import hugging_face_run, max_relative, plan_run, shared_references
from galva_schema import Strategy

STEPS, TOL = 3, 1e-5
# bf16 compute with fp32 masters against the fp32 Hugging Face run: galva-hp's bound for bf16 plans
# (tests/test_matrix.py BF16_TOL: loss 5e-3, gradient norm 2e-2 relative)
BF16_TOL = {"loss": 5e-3, "norm": 2e-2}


def _plan(**fields) -> Strategy:
    layer = fields.pop("layer")
    base = {"world_size": 4, "pp": 2, "global_batch_size": 8, "num_micro_batches": 2, "mixed_precision": "fp32"}
    return Strategy.model_validate({**base, "layers": [{**layer, "checkpoint": True}] * 4, **fields})


PLANS = {
    "pp2-tp2-vtp2-1f1b": _plan(layer={"tp": 2}, vocab={"tp": 2}),
    "pp2-tp2-megatron_sp-vtp2-gpipe": _plan(
        layer={"tp": 2}, megatron_sp=True, vocab={"tp": 2}, pipeline_schedule="gpipe"
    ),
    "pp2-ulysses2-vsp2": _plan(layer={"tp": 2, "ulysses": True}, vocab={"tp": 2, "sp": True}),
    "pp2-tp2-strided-vtp1-zero3": _plan(layer={"tp": 2, "tp_consecutive": False}, default_dp_type="zero3"),
    # tp 4 > 2 key/value heads: each rank computes the one K/V head its query heads use
    "pp1-tp4-gqa-vtp4": _plan(layer={"tp": 4}, pp=1, vocab={"tp": 4}),
    # embedding and head on one rank holding one shared tensor (GPT-2's tie at vocabulary degree 1), ddp
    "pp1-dp4-ddp": _plan(layer={}, pp=1),
    # a different plan per layer (Galva's search output): tp2 / dp2-ZeRO-3 / Ulysses 2 / strided tp2
    "pp2-per-layer-mixed": Strategy.model_validate(
        {
            "world_size": 4,
            "pp": 2,
            "global_batch_size": 8,
            "num_micro_batches": 2,
            "mixed_precision": "fp32",
            "layers": [
                {"tp": 2, "checkpoint": True},
                {"dp_type": "zero3"},
                {"tp": 2, "ulysses": True, "checkpoint": True},
                {"tp": 2, "tp_consecutive": False},
            ],
            "vocab": {"tp": 2},
        }
    ),
}
CASES = [
    ("llama", "pp2-tp2-vtp2-1f1b"),
    ("llama", "pp2-tp2-megatron_sp-vtp2-gpipe"),
    ("llama", "pp2-ulysses2-vsp2"),
    ("llama", "pp2-tp2-strided-vtp1-zero3"),
    ("llama", "pp2-per-layer-mixed"),
    ("llama", "pp1-tp4-gqa-vtp4"),
    ("gpt2", "pp2-per-layer-mixed"),
    ("gpt2", "pp2-tp2-vtp2-1f1b"),
    ("gpt2", "pp2-tp2-megatron_sp-vtp2-gpipe"),
    ("gpt2", "pp2-ulysses2-vsp2"),
    ("gpt2", "pp1-dp4-ddp"),
    ("qwen2", "pp2-tp2-megatron_sp-vtp2-gpipe"),
    ("mistral", "pp2-tp2-vtp2-1f1b"),
    # sliding-window attention over a sequence twice the window: Mistral on every layer, Qwen2 on its last two
    ("mistral-sw", "pp2-tp2-vtp2-1f1b"),
    ("mistral-sw", "pp2-ulysses2-vsp2"),
    ("mistral-sw", "pp2-per-layer-mixed"),  # degree-1 layers: the Hugging Face layer with a banded mask
    ("qwen2-sw", "pp2-tp2-megatron_sp-vtp2-gpipe"),
    ("qwen2-sw", "pp2-ulysses2-vsp2"),
    ("qwen2-sw", "pp2-per-layer-mixed"),
]


def sliding_window_config(family: str):
    """``tiny-<family>``, or for ``mistral-sw`` / ``qwen2-sw`` the tiny preset with a window of half the sequence
    (Mistral: every layer; Qwen2: the last two of four, as ``max_window_layers=2`` gives)."""
    base, _, variant = family.partition("-")
    config = preset_config(f"tiny-{base}")
    if variant == "sw":
        config.sliding_window = SEQ // 2
        if base == "qwen2":
            config.use_sliding_window = True
            config.max_window_layers = 2
            config.layer_types = ["full_attention"] * 2 + ["sliding_attention"] * 2
    return config


def _models(family: str):
    torch.manual_seed(0)
    return build_layered(sliding_window_config(family))


def hf_reference(family: str) -> tuple[list[float], list[float]]:
    return hugging_face_run(_models(family)[0], STEPS)


def galva_run(family: str, plan: str) -> tuple[list[float], list[float]]:
    return plan_run(_models(family)[1], PLANS[plan], STEPS)


_rel = max_relative


def check_cases(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[str, tuple[float, float]]:
    out = {}
    references = shared_references(list(dict.fromkeys(f for f, _ in cases)), hf_reference)  # each run by one rank
    for family, plan in cases:
        losses, norms = galva_run(family, plan)
        ref_losses, ref_norms = references[family]
        out[f"{family}/{plan}"] = (_rel(losses, ref_losses), _rel(norms, ref_norms))
    return out


@pytest.mark.distributed
def test_hybrid_plans_train_like_hugging_face():
    results = run_distributed(check_cases, 4, CASES, timeout=400)
    for case, (loss_diff, norm_diff) in results[0].items():
        for rank_result in results:  # every rank reports the same global loss and norm
            assert rank_result[case] == pytest.approx((loss_diff, norm_diff), abs=1e-9), case
        assert loss_diff < TOL, f"{case}: loss differs from Hugging Face by {loss_diff:.2e} (relative)"
        assert norm_diff < TOL, f"{case}: grad norm differs from Hugging Face by {norm_diff:.2e} (relative)"


# ------------------------------------------------------------------ encoder, encoder-decoder and vision families
# Bidirectional attention in tp / Megatron-SP / Ulysses form for BERT and ViT, tp for Swin (its window attention on
# the whole patch grid, split by heads; more in test_tables.py), and for T5 (self- and cross-attention reading
# each stack's shared relative-position table for the rank's heads, FFN column/row parallel). BERT's embedding and
# MLM head also run vocabulary-parallel (tp, tp with Megatron-SP, sp); the others stay at vocab degree 1.
def _enc_plan(layer: dict, **fields) -> dict:
    base = {"world_size": 4, "pp": 2, "global_batch_size": 8, "num_micro_batches": 2, "mixed_precision": "fp32"}
    return {**base, "layers": [{**layer, "checkpoint": True}], **fields}


ENCODER_PLANS = {
    "pp2-dp2-zero3": _enc_plan({}, default_dp_type="zero3"),
    "pp2-dp2-ddp": _enc_plan({}),
    "pp2-tp2-zero3": _enc_plan({"tp": 2}, default_dp_type="zero3"),
    "pp2-tp2-megatron_sp": _enc_plan({"tp": 2}, megatron_sp=True),
    "pp2-ulysses2": _enc_plan({"tp": 2, "ulysses": True}),
    "pp2-tp2": _enc_plan({"tp": 2}),
    "pp2-tp2-vtp2": _enc_plan({"tp": 2}, vocab={"tp": 2}),
    "pp2-tp2-megatron_sp-vtp2": _enc_plan({"tp": 2}, megatron_sp=True, vocab={"tp": 2}),
    "pp2-ulysses2-vsp2": _enc_plan({"tp": 2, "ulysses": True}, vocab={"tp": 2, "sp": True}),
    "pp1-tp4-vtp4": _enc_plan({"tp": 4}, pp=1, vocab={"tp": 4}),
    # pp1 with ddp vocabulary modules: an embedding/head tie that Hugging Face makes one tensor must still be
    # summed once and updated once (galva-hp gives the head its own copy at build time)
    "pp1-dp4-ddp": _enc_plan({}, pp=1),
    "pp1-tp2-ddp": _enc_plan({"tp": 2}, pp=1),
    "pp1-tp2-zero2": _enc_plan({"tp": 2}, pp=1, default_dp_type="zero2"),
    "pp1-tp4": _enc_plan({"tp": 4}, pp=1),
    # galva-train's default precision: bf16 compute with fp32 masters (images enter in bf16)
    "pp2-tp2-bf16": _enc_plan({"tp": 2}, mixed_precision="bf16"),
    "pp2-dp2-zero3-bf16": _enc_plan({}, default_dp_type="zero3", mixed_precision="bf16"),
    "pp2-ulysses2-bf16": _enc_plan({"tp": 2, "ulysses": True}, mixed_precision="bf16"),
    # T5's encoder (layers 0-1) split over the stages: its relative-position table read on both
    "pp2-split1|3-ddp": _enc_plan({}, pp_division=[1, 3]),
    "pp2-split1|3-tp2-megatron_sp-zero3": _enc_plan(
        {"tp": 2}, pp_division=[1, 3], megatron_sp=True, default_dp_type="zero3"
    ),
    "pp2-split1|3-ulysses2": _enc_plan({"tp": 2, "ulysses": True}, pp_division=[1, 3]),
    # zero-bubble H1: stage 1 splits its backward over both decoder layers (4 micro-batches: I and W interleave)
    "pp2-zb-h1": _enc_plan({}, pipeline_schedule="zb-h1", num_micro_batches=4),
    # interleaved 1F1B: two model chunks per stage (one layer each), tp2 inside them
    "pp2-interleaved-tp2": _enc_plan({"tp": 2}, pipeline_schedule="interleaved-1f1b", virtual_stages=2),
}
ENCODER_CASES = [
    ("bert", "pp2-tp2-zero3"),
    ("bert", "pp2-tp2-megatron_sp"),
    ("bert", "pp2-ulysses2"),
    ("bert", "pp2-tp2-vtp2"),  # word table / tied MLM decoder split over the vocabulary, re-tied across stages
    ("bert", "pp2-tp2-megatron_sp-vtp2"),
    ("bert", "pp2-ulysses2-vsp2"),
    ("bert", "pp1-tp4-vtp4"),  # embedding and head on one stage: the tie is summed on one rank
    ("bert", "pp1-dp4-ddp"),  # the same with the tied weight one shared tensor at vocabulary degree 1
    ("vit", "pp2-tp2-zero3"),
    # vocab tp for images: the classifier split over the labels (vocab-parallel loss, one label per sample); under
    # Megatron-SP the patch embedding hands the first layer its sequence slice
    ("vit", "pp2-tp2-vtp2"),
    ("vit", "pp1-tp4-vtp4"),  # 10 labels padded to 12 over 4 ranks
    ("swin", "pp2-tp2-vtp2"),  # Swin's window attention split by heads, its pooled classifier by labels
    # bf16 (galva-train's default): pixels enter in the compute dtype in every plan; bound BF16_TOL
    ("vit", "pp2-tp2-bf16"),
    ("vit", "pp2-dp2-zero3-bf16"),
    ("swin", "pp2-tp2-bf16"),
    ("t5", "pp2-dp2-ddp"),  # encoder on stage 0, decoder on stage 1 (each stack keeps its shared table on one stage)
    ("t5", "pp2-tp2"),  # the same split; layers and each stack's relative-position table split over 2 ranks by heads
    ("t5", "pp1-tp2-ddp"),  # both stacks on one stage: each table shard summed once over dp 2 (its first layer's unit)
    ("t5", "pp1-tp2-zero2"),  # the same with the layers sharded by FSDP2 (ZeRO-2)
    ("t5", "pp1-tp4"),  # one head (and one table column) per rank
    # every layer's copy of its stack's table read through galva-hp's shared parameters: ZeRO-3 shards the layers,
    # not the table; Megatron-SP and Ulysses slice [encoder ; decoder] into contiguous blocks (tiny-t5: 12 + 6
    # positions, so a tp-2 slice of 9 holds rows of both streams); a stack may straddle two stages
    ("t5", "pp2-dp2-zero3"),
    ("t5", "pp2-tp2-zero3"),
    ("t5", "pp2-tp2-megatron_sp"),
    ("t5", "pp2-ulysses2"),
    ("t5", "pp2-split1|3-ddp"),
    ("t5", "pp2-split1|3-tp2-megatron_sp-zero3"),
    ("t5", "pp2-split1|3-ulysses2"),
    ("t5", "pp2-dp2-zero3-bf16"),  # bf16: every layer reads the fp32 table copy cast to bf16
    ("t5", "pp2-ulysses2-bf16"),
    # both decoder layers on the split stage read the decoder's table: its gradient is taken in the input pass
    ("t5", "pp2-zb-h1"),
    # every schedule for every family: ZB-H1 and interleaved 1F1B for the encoder and image families too
    ("bert", "pp2-zb-h1"),
    ("vit", "pp2-zb-h1"),
    ("swin", "pp2-zb-h1"),
    ("bert", "pp2-interleaved-tp2"),
    ("vit", "pp2-interleaved-tp2"),
    ("swin", "pp2-interleaved-tp2"),
    ("t5", "pp2-interleaved-tp2"),
]
ENC_SEQ = 12


def _family_batches(family: str, config) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    """Per step: (HF keyword inputs, Galva inputs, Galva labels)."""
    from galva_models.data import RandomImageSource, RandomMaskedTokenSource, RandomSeq2SeqSource

    out = []
    for step in range(STEPS):
        if family == "bert":
            b = RandomMaskedTokenSource(config.vocab_size, ENC_SEQ, 8, mask_token_id=3, seed=5).batch(step)
            out.append(({"input_ids": b.inputs, "labels": b.labels}, b.inputs, b.labels))
        elif family == "t5":
            b = RandomSeq2SeqSource(config, ENC_SEQ, 6, 8, seed=5).batch(step)
            out.append(({"input_ids": b.inputs[:, :ENC_SEQ], "labels": b.labels}, b.inputs, b.labels))
        else:
            b = RandomImageSource(config.image_size, config.num_channels, config.num_labels, 8, seed=5).batch(step)
            out.append(({"pixel_values": b.inputs, "labels": b.labels}, b.inputs, b.labels))
    return out


def _encoder_models(family: str):
    torch.manual_seed(0)
    options = {"encoder_seq_length": ENC_SEQ} if family == "t5" else {}
    return build_layered(preset_config(f"tiny-{family}"), **options)


def _encoder_reference(family: str) -> tuple[list[float], list[float]]:
    """The Hugging Face model's own losses and clipped gradient norms on the family's batches, fp32 AdamW."""
    model, _ = _encoder_models(family)
    params = list(model.parameters())
    optimizer, scheduler = reference_optimizer(params, OPTIM)
    losses, norms = [], []
    for hf_inputs, _, _ in _family_batches(family, model.config):
        optimizer.zero_grad()
        loss = model(**hf_inputs).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, OPTIM.max_grad_norm)))
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, norms


def check_encoder_families(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[str, tuple[float, float]]:
    out = {}
    # per family: its plans share one reference, run by one rank; every rank reports the same global loss and norm
    references = shared_references(list(dict.fromkeys(f for f, _ in cases)), _encoder_reference)
    for family, plan in cases:
        ref_losses, ref_norms = references[family]
        model, layered = _encoder_models(family)
        batches = _family_batches(family, model.config)
        fields = ENCODER_PLANS[plan]
        strategy = Strategy.model_validate({**fields, "layers": fields["layers"] * layered.num_layers})
        built = build(layered, strategy, BuildOptions(seq_len=ENC_SEQ if family == "bert" else None))
        galva_opt = GalvaOptimizer(built.param_records(), OPTIM)
        losses, norms = [], []
        for _, inputs, labels in batches:
            metrics = train_step(built, galva_opt, inputs, labels)
            losses.append(metrics.loss)
            norms.append(metrics.grad_norm)
        if rank == 0:
            out[f"{family}/{plan}"] = (_rel(losses, ref_losses), _rel(norms, ref_norms))
    return out


@pytest.mark.distributed
def test_encoder_and_vision_families_train_like_hugging_face():
    results = run_distributed(check_encoder_families, 4, ENCODER_CASES, timeout=400)
    assert sorted(results[0]) == sorted(f"{f}/{p}" for f, p in ENCODER_CASES)
    for case, (loss_diff, norm_diff) in results[0].items():
        loss_tol, norm_tol = (BF16_TOL["loss"], BF16_TOL["norm"]) if case.endswith("-bf16") else (TOL, TOL)
        assert loss_diff < loss_tol, f"{case}: loss differs from Hugging Face by {loss_diff:.2e} (relative)"
        assert norm_diff < norm_tol, f"{case}: grad norm differs from Hugging Face by {norm_diff:.2e} (relative)"


# ------------------------------------------------------------------------------ gathered state of parallel forms
def check_gathered_names(rank: int, world_size: int) -> dict[str, str]:
    """For every family and layer form: the form's gathered single-process state equals the layer's own state
    (same names, same layouts, exactly the same values). Returns problems by case (empty when all agree)."""
    import torch.distributed as dist

    from galva_hp import ParallelContext
    from galva_hp.parallel.tensor_parallel import gather_full_state

    group = dist.new_group(list(range(world_size)))
    contexts = {
        "tp": ParallelContext(tp_group=group),
        "megatron_sp": ParallelContext(tp_group=group, megatron_sp=True),
        "ulysses": ParallelContext(sp_group=group),
    }
    problems = {}
    problems.update(_t5_gathered(group))
    problems.update(_bert_vocab_gathered(group))
    for family in ("gpt2", "llama", "qwen2", "bert", "vit", "swin"):  # swin's layers[1] ends its stage: merging too
        _, layered = _encoder_models(family)
        layer = layered.layers[1]
        expected = {name: p.detach() for name, p in layer.named_parameters()}
        for form, ctx in contexts.items():
            if family == "swin" and form != "tp":  # its layers need the whole grid: the sequence forms are refused
                continue
            # a copy per form: the families run from their tables are parallelized in place, once
            parallel = layered.parallelizer.layer(copy.deepcopy(layer), layered.layer_types[1], ctx)
            got = gather_full_state(parallel)
            if set(got) != set(expected):
                problems[f"{family}/{form}"] = f"names differ: {sorted(set(got) ^ set(expected))[:4]}"
            elif any(not torch.equal(got[n], expected[n]) for n in expected):
                problems[f"{family}/{form}"] = "values differ"
    return problems


def _t5_gathered(group) -> dict[str, str]:
    """T5's tp, Megatron-SP and Ulysses forms of every layer, converted in any order: the layer's own state less its
    stack's relative-position table (a galva-hp shared parameter, read by every layer through its bias). A copy per
    form: the layers take their forms in place, once."""
    from galva_hp import ParallelContext
    from galva_hp.parallel.tensor_parallel import gather_full_state

    _, layered = _encoder_models("t5")
    shared = {(w.home, w.path) for w in layered.shared if not w.in_place}
    problems = {}
    for form, ctx in {
        "tp": ParallelContext(tp_group=group),
        "megatron_sp": ParallelContext(tp_group=group, megatron_sp=True),
        "ulysses": ParallelContext(sp_group=group),
    }.items():
        for index in reversed(range(layered.num_layers)):  # later layers first: no order is needed
            layer, layer_type = layered.layers[index], layered.layer_types[index]
            expected = {n: p.detach() for n, p in layer.named_parameters() if (f"layers.{index}", n) not in shared}
            got = gather_full_state(layered.parallelizer.layer(copy.deepcopy(layer), layer_type, ctx))
            got = {n: t for n, t in got.items() if (f"layers.{index}", n) not in shared}
            if set(got) != set(expected):
                problems[f"t5/{form}/layers.{index}"] = f"names differ: {sorted(set(got) ^ set(expected))[:4]}"
            elif any(not torch.equal(got[n], expected[n]) for n in expected):
                problems[f"t5/{form}/layers.{index}"] = "values differ"
    return problems


def _bert_vocab_gathered(group) -> dict[str, str]:
    """The vocabulary-parallel embedding and head of BERT (MLM head), ViT and Swin (patch embedding, classifier)
    gather to the single-process names and values."""
    problems = {}
    for family in ("bert", "vit", "swin"):
        problems.update(_vocab_gathered(family, group))
    return problems


def _vocab_gathered(family: str, group) -> dict[str, str]:
    from galva_hp import ParallelContext
    from galva_hp.parallel.tensor_parallel import gather_full_state

    problems = {}
    for form, ctx in {
        "vtp": ParallelContext(tp_group=group),
        "vtp-sp": ParallelContext(tp_group=group, megatron_sp=True),
    }.items():
        _, layered = _encoder_models(family)  # a model per form: the table families are parallelized in place, once
        for part, module in (("embedding", layered.embedding), ("head", layered.head)):
            expected = {name: p.detach() for name, p in module.named_parameters()}
            convert = layered.parallelizer.embedding if part == "embedding" else layered.parallelizer.head
            got = gather_full_state(convert(module, ctx))
            if set(got) != set(expected):
                problems[f"{family}/{form}/{part}"] = f"names differ: {sorted(set(got) ^ set(expected))[:4]}"
            elif any(not torch.equal(got[n], expected[n]) for n in expected):
                problems[f"{family}/{form}/{part}"] = "values differ"
    return problems


@pytest.mark.distributed
def test_parallel_forms_gather_to_single_process_names():
    assert run_distributed(check_gathered_names, 2, timeout=200) == [{}, {}]


# ------------------------------------------------------------------ galva-train's defaults on every family
TRAIN_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "bert", "t5", "vit", "swin")


def train_every_family(rank: int, world_size: int) -> dict[str, object]:
    """``galva-train --model tiny-<family> --pp 2 --tp 2`` with its default precision (bf16) for 2 steps, every family
    in the same 4 ranks (galva-train's final ``destroy_process_group`` is skipped so the next family reuses the
    world). Returns galva-train's exit code per family, and the default precision."""
    import os

    import torch.distributed as dist

    from galva_models.cli.config import parse_train_config
    from galva_models.cli.train import main

    os.environ["WORLD_SIZE"] = str(world_size)
    dist.destroy_process_group = lambda *args, **kwargs: None  # this forked rank only
    out: dict[str, object] = {}
    for family in TRAIN_FAMILIES:
        argv = ["--model", f"tiny-{family}", "--pp", "2", "--tp", "2", "--global-batch-size", "4", "--chunks", "2",
                "--train-iters", "2", "--no-progress", "--log-interval", "1"]  # fmt: skip
        if family not in ("vit", "swin"):  # images fix their own sequence
            argv += ["--seq-length", "16"]
        out[f"{family}/precision"] = parse_train_config(argv).strategy.mixed_precision.value
        out[family] = main(argv)
    return out


@pytest.mark.distributed
def test_galva_train_defaults_train_every_family_under_pp2_tp2():
    results = run_distributed(train_every_family, 4, timeout=400)
    for family in TRAIN_FAMILIES:
        assert results[0][f"{family}/precision"] == "bf16", family
        assert all(r[family] == 0 for r in results), f"{family}: galva-train exited with {[r[family] for r in results]}"
