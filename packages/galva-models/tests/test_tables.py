"""Families from their own tables, parallelized in place, train like single-process Hugging Face training.

Every family here is a tiny random config of transformers' own config class (``tiny-<model_type>``: the tiny Llama's
sizes, the family's defaults otherwise, dropout off, sliding windows of half the sequence) and is run by the one
table adapter: no Galva code names it. Oracle: the Hugging Face model (``model(input_ids, labels=input_ids).loss``)
with fp32 AdamW, clipping and the same schedule. Tolerance: 1e-5 relative on every step's loss and gradient norm
over 3 steps (the galva-hp bound), bf16 rows within galva-hp's bf16 bound. Three steps, as tests/test_distributed.py
takes: the two warm-up steps and the first of the decay, the third loss and norm after an update that used AdamW's
moments of the first; a fourth step runs the same code again (about a quarter of these launches' time).
"""

from __future__ import annotations

import pytest
import torch

from galva_comm.testing import run_distributed
from galva_hp.testing.oracle import SEQ
from galva_models.presets import preset_config, tiny_config
from galva_models.tables import ADAPTER, supports
from galva_models.testing import (
    hugging_face_run,
    hugging_face_task_run,
    max_relative,
    plan_run,
    shared_references,
    task_batches,
)
from galva_models.tiny_layers import per_layer_lists
from galva_schema import Strategy, plan_problems

TOL = 1e-5
STEPS = 3
BF16_TOL = {"loss": 5e-3, "norm": 2e-2}  # galva-hp's bound for bf16 compute with fp32 masters

DENSE = [
    "gpt2",
    "llama",
    "mistral",
    "ministral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi",
    "phi3",
    "olmo2",
    "granite",
    "starcoder2",
    "cohere",
    "glm4",
    "gpt_neox",
    "smollm3",
    "exaone4",
    "ernie4_5",
    "seed_oss",
    "apertus",
    "arcee",
    "olmo",
    "olmo3",
    "helium",
    "glm",
    "cohere2",
    "internlm3",
]
"""Dense causal-LM families with tables that build on CPU (transformers' own, and Galva's for GPT-2)."""

_BASE = {"world_size": 4, "global_batch_size": 8, "num_micro_batches": 2, "mixed_precision": "fp32"}


def _plan(layers: list[dict], **fields) -> Strategy:
    return Strategy.model_validate({**_BASE, "pp": 1, "layers": layers, **fields})


PLANS = {
    "tp2": _plan([{"tp": 2}] * 4, vocab={"tp": 2}),
    "tp2-megatron_sp": _plan([{"tp": 2, "checkpoint": True}] * 4, megatron_sp=True, vocab={"tp": 2}),
    "ulysses2": _plan([{"tp": 2, "ulysses": True}] * 4, vocab={"tp": 2, "sp": True}),
    "pp2-zero3": _plan([{"checkpoint": True}] * 4, pp=2, default_dp_type="zero3"),
    # a different form per layer on 4 ranks: tp2 / ZeRO-3 / Ulysses 2 / strided tp4 over two stages
    "pp2-mixed": _plan(
        [
            {"tp": 2, "checkpoint": True},
            {"dp_type": "zero3"},
            {"tp": 2, "ulysses": True},
            {"tp": 2, "tp_consecutive": False},
        ],
        pp=2,
        vocab={"tp": 2},
    ),
    "tp4-bf16": _plan([{"tp": 4}] * 4, vocab={"tp": 4}, mixed_precision="bf16"),
    # the two schedules beyond GPipe and 1F1B: interleaved (2 chunks of one layer per stage) and zero-bubble ZB-H1
    "pp2-interleaved-tp2": _plan(
        [{"tp": 2, "checkpoint": True}] * 4, pp=2, pipeline_schedule="interleaved-1f1b", virtual_stages=2
    ),
    "pp2-zb-h1-ulysses2": _plan([{"tp": 2, "ulysses": True}] * 4, pp=2, pipeline_schedule="zb-h1"),
    # expert layouts (mixtures of experts): ep x etp x expert dp = the stage's ranks, whatever the attention's form
    "ep2": _plan([{"ep": 2}] * 4),
    "ep4": _plan([{"ep": 4}] * 4),
    "ep2-etp2": _plan([{"ep": 2, "etp": 2}] * 4),
    "tp2-ep2": _plan([{"tp": 2, "ep": 2}] * 4, vocab={"tp": 2}),
    "ulysses2-ep2": _plan([{"tp": 2, "ulysses": True, "ep": 2}] * 4, vocab={"tp": 2, "sp": True}),
    "pp2-ep2-zero3": _plan([{"ep": 2, "dp_type": "zero2", "expert_dp_type": "zero3"}] * 4, pp=2),
    # a different attention and expert form per layer, every layer recomputed, two stages
    "pp2-mixed-ep": _plan(
        [
            {"tp": 2, "ep": 2, "checkpoint": True},
            {"etp": 2, "expert_dp_type": "zero3", "checkpoint": True},
            {"tp": 2, "ulysses": True, "ep": 2, "checkpoint": True},
            {"ep": 2, "dp_type": "zero3", "checkpoint": True},
        ],
        pp=2,
    ),
    "pp2-interleaved-ep2": _plan(
        [{"ep": 2, "checkpoint": True}] * 4, pp=2, pipeline_schedule="interleaved-1f1b", virtual_stages=2
    ),
    "pp2-zb-h1-ulysses2-ep2": _plan([{"tp": 2, "ulysses": True, "ep": 2}] * 4, pp=2, pipeline_schedule="zb-h1"),
    "ep2-etp2-bf16": _plan([{"ep": 2, "etp": 2, "expert_dp_type": "zero3"}] * 4, mixed_precision="bf16"),
}


CP_SEQ = 256
"""Context-parallel rows run longer sequences: 2 x cp chunks of 32 tokens and more."""

CP_PLANS = {
    "cp2": _plan([{"cp": 2}] * 4, vocab={"cp": 2}),
    "cp4": _plan([{"cp": 4}] * 4, vocab={"cp": 4}),
    "cp2-tp2-megatron_sp": _plan([{"tp": 2, "cp": 2}] * 4, megatron_sp=True, vocab={"tp": 2, "cp": 2}),
    "cp2-ulysses2": _plan([{"tp": 2, "ulysses": True, "cp": 2}] * 4, vocab={"tp": 2, "sp": True, "cp": 2}),
    "pp2-cp2-zero3": _plan([{"cp": 2, "checkpoint": True}] * 4, pp=2, default_dp_type="zero3", vocab={"cp": 2}),
    # a different cp per layer (every boundary re-shards the two-chunk shares), checkpointed, vocabulary tp
    "mixed-cp": _plan(
        [
            {"cp": 2, "checkpoint": True},
            {"cp": 4},
            {"tp": 2, "cp": 2, "checkpoint": True},
            {"tp": 2, "ulysses": True, "cp": 2, "checkpoint": True},
        ],
        vocab={"tp": 2},
    ),
}
"""Context parallelism alone and with every form it composes with, on 4 ranks."""


def _config(family: str, seq: int = SEQ):
    # a window that is not a multiple of the ring's chunks: some blocks are partly inside, some skipped
    return tiny_config(family, sliding_window=seq // 2 if seq == SEQ else seq // 2 - seq // 8 + 3)


def _model(family: str, seq: int = SEQ):
    torch.manual_seed(0)
    return ADAPTER.build_model(_config(family, seq))


def hf_reference(family: str, seq: int = SEQ) -> tuple[list[float], list[float]]:
    # a mixture of experts' router loss is one statistic per micro-batch: Hugging Face accumulates the plans' ones
    experts = any(t.num_experts for t in _constraints(_config(family, seq)).layer_types)
    micro_batches = _BASE["num_micro_batches"] if experts else 1
    return hugging_face_run(_model(family, seq), steps=STEPS, seq=seq, micro_batches=micro_batches)


def galva_run(family: str, plan: str) -> tuple[list[float], list[float]]:
    if plan in CP_PLANS:
        return plan_run(ADAPTER.decompose(_model(family, CP_SEQ)), CP_PLANS[plan], steps=STEPS, seq_len=CP_SEQ)
    return plan_run(ADAPTER.decompose(_model(family)), PLANS[plan], steps=STEPS)


_rel = max_relative


def _runs(cases: list[tuple[str, str]]) -> dict[tuple[str, int], list[str]]:
    """The plans of ``cases`` by (family, sequence length), in the order given."""
    runs: dict[tuple[str, int], list[str]] = {}
    for family in dict.fromkeys(f for f, _ in cases):
        for seq, plans in ((SEQ, PLANS), (CP_SEQ, CP_PLANS)):
            chosen = [p for f, p in cases if f == family and p in plans]
            if chosen:
                runs[family, seq] = chosen
    return runs


def check(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[str, tuple[float, float]]:
    runs = _runs(cases)
    # each single-process reference runs once, on one rank; every rank reports the same global loss and norm
    refs = shared_references(list(runs), lambda key: hf_reference(*key))
    out = {}
    for (family, seq), chosen in runs.items():
        for plan in chosen:
            losses, norms = galva_run(family, plan)
            if rank == 0:
                ref = refs[family, seq]
                out[f"{family}/{plan}"] = (_rel(losses, ref[0]), _rel(norms, ref[1]))
    return out


def launch(fn, cases: list[tuple[str, str]]) -> list[dict[str, tuple[float, float]]]:
    """``fn(cases)`` on 4 ranks. Each family's constraints are found here first: their probe of the family's own code
    (galva_models.tables.mixing, cached per process) is then inherited by the forked ranks, not run by each."""
    for (family, seq), _ in _runs(cases).items():
        _constraints(encoder_config(family) if family in ENCODER_PLANS else _config(family, seq))
    return run_distributed(fn, 4, cases, timeout=900)


def _assert(results: list[dict[str, tuple[float, float]]]) -> None:
    for case, (loss_diff, norm_diff) in results[0].items():
        tol = (BF16_TOL["loss"], BF16_TOL["norm"]) if "bf16" in case else (TOL, TOL)
        assert loss_diff < tol[0], f"{case}: loss differs from Hugging Face by {loss_diff:.2e} (relative)"
        assert norm_diff < tol[1], f"{case}: grad norm differs from Hugging Face by {norm_diff:.2e} (relative)"


BF16 = ["gpt2", "llama", "qwen3", "gemma2", "phi3", "olmo2", "cohere", "apertus"]
"""bf16 rows for one family of each attention and MLP shape (Conv1D and packed q/k/v, GQA, qk-norm before and after
the gather, soft-capping, fused gate/up, a parallel block, a learned activation): the bf16 path itself is galva-hp's,
the same for every family."""
SWEEP = [
    (family, plan)
    for family in DENSE
    for plan in ("tp2", "tp2-megatron_sp", "ulysses2", "pp2-zero3", "pp2-mixed")
] + [(family, "tp4-bf16") for family in BF16]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]
"""Mixtures of experts (tiny: 4 experts, top-2, the router's load-balancing loss in the loss; DeepSeek with its
dense first layer, shared experts and group-limited routing), from transformers' expert-parallel table."""

EXPERT_PLANS = ["ep2", "ep4", "ep2-etp2", "tp2-ep2", "ulysses2-ep2", "pp2-ep2-zero3", "pp2-mixed-ep"]


@pytest.mark.distributed
@pytest.mark.parametrize("families", [DENSE[i : i + 7] for i in range(0, len(DENSE), 7)], ids=lambda f: f[0])
def test_families_train_like_hugging_face(families: list[str]):
    cases = [(f, p) for f, p in SWEEP if f in families]
    _assert(launch(check, cases))


CP_FAMILIES = ["llama", "qwen2", "mistral", "bert"]
"""Plain attention (Llama), with biases on q/k/v (Qwen 2), with a sliding window shorter than the sequence (Mistral),
and bidirectional (BERT's masked LM: every block of the ring is whole)."""


def check_context_parallel(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[str, tuple[float, float]]:
    """``check`` for the causal LMs and ``check_encoders`` for the encoders, in one launch."""
    out = check(rank, world_size, [(f, p) for f, p in cases if f not in ENCODER_PLANS])
    out.update(check_encoders(rank, world_size, [(f, p) for f, p in cases if f in ENCODER_PLANS]))
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_context_parallel_training_equals_hugging_face():
    """Ring attention on the table path: cp2, cp4, cp2 x tp2 with Megatron-SP, cp2 x Ulysses 2, pp2 x cp2 with
    ZeRO-3 and a checkpointed plan with a different cp per layer, 256 tokens, 3 fp32 steps within 1e-5."""
    results = launch(check_context_parallel, [(f, p) for f in CP_FAMILIES for p in CP_PLANS])
    assert len(results[0]) == len(CP_FAMILIES) * len(CP_PLANS)
    _assert(results)


def test_a_family_whose_attention_the_ring_does_not_compute_refuses_cp_in_one_line():
    from galva_models.tables.adapter import constraints, ring_refusal

    problems = plan_problems(CP_PLANS["cp2"], constraints(_config("gemma2")), world_size=4, seq_len=CP_SEQ)
    assert problems[0] == (
        "layers[0..3].cp: gemma2 layers cannot run context parallelism: gemma2's attention soft-caps its scores, "
        "which ring attention does not compute"
    ), problems
    assert all("\n" not in p for p in problems)
    sinks = ring_refusal(tiny_config("gpt_oss"))
    assert sinks == "gpt_oss's attention has sinks, which ring attention does not compute"
    assert plan_problems(CP_PLANS["cp4"], constraints(_config("mistral")), world_size=4, seq_len=CP_SEQ) == []


def test_every_family_in_the_sweep_is_taken_by_its_tables():
    for family in DENSE + MOE:
        assert supports(_config(family)), family


@pytest.mark.distributed
@pytest.mark.parametrize("families", [DENSE[i : i + 15] for i in range(0, len(DENSE), 15)], ids=lambda f: f[0])
def test_every_family_under_the_interleaved_and_zero_bubble_schedules(families: list[str]):
    cases = [(f, p) for f in families for p in ("pp2-interleaved-tp2", "pp2-zb-h1-ulysses2")]
    _assert(launch(check, cases))


@pytest.mark.slow
@pytest.mark.distributed
def test_mixtures_of_experts_train_like_hugging_face_under_expert_layouts():
    """Every expert layout row, loss (router loss included) and gradient norm within 1e-5 of Hugging Face."""
    cases = [(family, plan) for family in MOE for plan in EXPERT_PLANS]
    # the router statistics across interleaved chunks and zero-bubble's split backward; bf16 experts
    cases += [("mixtral", plan) for plan in ("pp2-interleaved-ep2", "pp2-zb-h1-ulysses2-ep2", "ep2-etp2-bf16")]
    results = launch(check, cases)
    _assert(results)
    assert len(results[0]) == len(cases)


def test_a_form_a_family_cannot_take_is_refused_in_one_line_by_the_search_s_check():
    """The constraints the search plans with refuse an expert layout that does not split the experts, expert fields
    on a model without experts, Megatron-SP where the tp table splits no attention (DeepSeek's latent attention),
    and a tp degree that splits no heads evenly, naming the layers; the same function galva-hp's build asks."""
    from galva_models.tables.adapter import constraints

    six = _config("mixtral")
    six.num_local_experts = 6
    problems = plan_problems(PLANS["ep4"], constraints(six), world_size=4, seq_len=SEQ)
    assert problems == ["layers[0..3].ep: ep 4 does not divide the 6 experts of mixtral layers"], problems
    problems = plan_problems(PLANS["ep2"], constraints(_config("llama")), world_size=4, seq_len=SEQ)
    assert problems == ["layers[0..3].ep: llama has no expert layers"], problems
    problems = plan_problems(PLANS["tp2-megatron_sp"], constraints(_config("deepseek_v3")), world_size=4, seq_len=SEQ)
    assert any("splits no attention module" in p for p in problems), problems
    assert not plan_problems(PLANS["tp2-ep2"], constraints(_config("mixtral")), world_size=4, seq_len=SEQ)
    odd = tiny_config("qwen3")
    odd.num_attention_heads, odd.num_key_value_heads = 6, 3
    problems = plan_problems(PLANS["tp4-bf16"], constraints(odd), world_size=4, seq_len=SEQ)
    assert any("tp 4 does not divide the 6 attention heads" in p for p in problems), problems


# ------------------------------------------------------------------------------------------- checkpoints, any family
def _round_trip(rank: int, world_size: int, bases: list[str], plan: list[str]) -> int:
    """galva-train --load (the h2g output) under pp2 x tp2 (vocab tp2) and ``plan`` for 2 steps, then save, for each
    directory of ``bases`` in turn; the caller compares each first loss with Hugging Face's and each save with the g2h
    export."""
    import torch.distributed as dist

    from galva_models.cli.config import parse_train_config
    from galva_models.cli.train import run

    for base in bases:
        if not dist.is_initialized():  # galva-train ends its group: one launch (one set of imports) for every family
            dist.init_process_group("gloo", init_method=f"file://{base}/group", rank=rank, world_size=world_size)
        argv = ["--load", f"{base}/g", *_ROUND_TRIP_ARGS, *plan, "--train-iters", "2", "--save", f"{base}/run",
                "--metrics-jsonl", f"{base}/m.jsonl", "--no-progress"]  # fmt: skip
        if run(parse_train_config(argv, world_size=world_size)) != 0:
            return 1
    return 0


_ROUND_TRIP_ARGS = ["--fp32", "--global-batch-size", "4", "--chunks", "2", "--seq-length", "16", "--pp", "2", "--tp",
                    "2", "--vocab-tp", "2"]  # fmt: skip


SAVED = DENSE
"""Every dense family; Apertus's xIELU activation also keeps two persistent buffers (``beta``, ``eps``) that
Hugging Face writes to disk: they are loaded, saved and exported like the parameters."""
SAVED_GROUPS = [SAVED[i : i + 14] for i in range(0, len(SAVED), 14)] + [MOE]
"""Launches of the round trip; the mixtures of experts train under ep2 as well (their fused expert tensors are one
tensor per expert and projection on disk)."""


def _first_loss(model, inputs, labels, micro_batches: int) -> float:
    """Hugging Face's loss on galva-train's first batch (labels already shifted): a mixture of experts adds its
    router loss per micro-batch (one statistic per forward), as galva-train does."""
    config = model.config
    if not getattr(config, "output_router_logits", False):
        logits = model.eval()(input_ids=inputs).logits
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    total = 0.0
    for ids, part in zip(inputs.chunk(micro_batches), labels.chunk(micro_batches)):
        out = model.eval()(input_ids=ids, output_router_logits=True)
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), part.flatten())
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + config.router_aux_loss_coef * out.aux_loss
        total += float(loss) / micro_batches
    return total


@pytest.mark.distributed
@pytest.mark.parametrize("families", SAVED_GROUPS, ids=lambda f: f[0])
def test_hugging_face_round_trip_for_every_family(tmp_path, families: list[str]):
    """HF checkpoint -> h2g -> galva-train --load (pp2 x tp2, vocab tp2, ep2 for the mixtures of experts; first
    loss == Hugging Face's) -> save -> g2h -> from_pretrained: every tensor equal to the saved one, with no
    per-family rename anywhere."""
    import json

    from transformers import AutoModelForCausalLM

    from galva_ckpt.checkpoint import CheckpointReader
    from galva_ckpt.convert import galva_to_hf, hf_to_galva
    from galva_models.cli.config import parse_train_config
    from galva_models.cli.train import make_source

    models = {}
    for family in families:
        base = tmp_path / family
        torch.manual_seed(5)
        model = ADAPTER.build_model(_config(family))
        with torch.no_grad():  # norms at 1 and biases at 0 would hide a swapped tensor (or an unloaded buffer)
            stored_buffers = [b for n, b in model.named_buffers() if n in model.state_dict() and b.is_floating_point()]
            for tensor in [*model.parameters(), *stored_buffers]:
                tensor.add_(torch.randn_like(tensor) * 0.02)
        model.save_pretrained(base / "hf")
        hf_to_galva(base / "hf", base / "g", progress=False)
        models[family] = model
    plan = ["--ep", "2"] if families == MOE else []
    bases = [str(tmp_path / family) for family in models]
    assert run_distributed(_round_trip, 4, bases, plan, timeout=600) == [0] * 4, families
    for family, model in models.items():
        base = tmp_path / family
        argv = ["--load", str(base / "g"), *_ROUND_TRIP_ARGS, *plan]
        batch = make_source(parse_train_config(argv, world_size=4)).batch(0)
        with torch.no_grad():
            reference = _first_loss(model, batch.inputs, batch.labels, micro_batches=2)
        first = json.loads((base / "m.jsonl").read_text().splitlines()[0])["loss"]
        assert abs(first - reference) < 1e-5, (family, first, reference)
        galva_to_hf(base / "run" / "step-00000002", base / "back", progress=False)
        back = AutoModelForCausalLM.from_pretrained(base / "back", local_files_only=True)
        reader = CheckpointReader(base / "run" / "step-00000002")
        saved = {n: t for m in reader.module_names for n, t in reader.read_module(m).items()}
        from transformers.core_model_loading import revert_weight_conversion  # the names written to disk

        state = revert_weight_conversion(
            back, {**dict(back.named_parameters(remove_duplicate=False)), **back.state_dict()}
        )
        for name, tensor in saved.items():
            assert torch.equal(state[name], tensor), (family, name)
        stored = set(saved) | set(reader.manifest.tied)
        assert stored >= {n for n in state if "rotary" not in n and not n.endswith("inv_freq")}, family


def _resume_under_other_expert_layouts(rank: int, world_size: int, root: str) -> dict[str, object]:
    """Mixtral under ep2: 2 steps, save, 2 more; then the save loaded under ep4 and under ep2 x etp2 for the same 2
    steps. Returns every run's last 2 (loss, grad norm) and the experts this rank's placements hold."""
    from galva_hp import BuildOptions, GalvaOptimizer, build, train_step
    from galva_hp.testing.oracle import OPTIM, batch
    from galva_models.checkpoint_names import checkpoint_names
    from galva_models.checkpointing import CheckpointIO, open_source, scheduler_state

    config = _config("mixtral")
    ids, labels = batch(seq=SEQ)

    def built(plan: str):
        model = build(ADAPTER.decompose(_model("mixtral")), PLANS[plan], BuildOptions(seq_len=SEQ))
        optimizer = GalvaOptimizer(model.param_records(), OPTIM)
        with torch.device("meta"):
            fresh = ADAPTER.build_model(config)
        layered = ADAPTER.decompose(fresh)
        return model, optimizer, CheckpointIO(model, optimizer, checkpoint_names(config), layered, config.to_dict())

    def steps(model, optimizer, which: range) -> list[tuple[float, float]]:
        return [
            (m.loss, float(m.grad_norm or 0)) for m in (train_step(model, optimizer, ids[s], labels[s]) for s in which)
        ]

    def experts(io: CheckpointIO) -> list[int]:  # expert indices of the on-disk tensors this rank writes or reads
        return sorted({int(p.tensor.split(".experts.")[1].split(".")[0]) for p in io.placements if p.part})

    model, optimizer, io = built("ep2")
    steps(model, optimizer, range(2))
    io.save(root, 2, scheduler_state(optimizer))
    out: dict[str, object] = {"ep2": steps(model, optimizer, range(2, 4)), "ep2/experts": experts(io)}
    for plan in RESUMED:
        model, optimizer, io = built(plan)
        assert io.load(open_source(f"{root}/step-00000002")) == 2
        out[plan], out[f"{plan}/experts"] = steps(model, optimizer, range(2, 4)), experts(io)
    return out


PLANS["ep2-expert-zero3"] = _plan([{"ep": 2, "expert_dp_type": "zero3"}] * 4)
RESUMED = {"ep4": 1, "ep2-etp2": 2, "ep2-expert-zero3": 1}
"""Plans an ep2 save resumes under, with the experts each rank holds: ep4 one; etp2 its ep rank's two (a part of
each); ZeRO-3 over the expert data-parallel pair shards ep2's two experts by expert (dim 0), one each."""


@pytest.mark.distributed
def test_a_mixture_of_experts_saved_under_ep2_resumes_under_ep4_and_etp2(tmp_path):
    """The next two steps after resuming an ep2 save under ep4, ep2 x etp2 or ep2 with ZeRO-3 experts equal the
    uninterrupted run (1e-5 relative, loss and gradient norm); each rank writes and reads only its own experts'
    tensors (a contiguous run of them), never the whole layer."""
    results = run_distributed(_resume_under_other_expert_layouts, 4, str(tmp_path), timeout=600)
    full = results[0]["ep2"]
    for plan in RESUMED:
        resumed = results[0][plan]
        for k in (0, 1):  # loss, grad norm
            diff = _rel([r[k] for r in resumed], [f[k] for f in full])
            assert diff < TOL, f"{plan}: {('loss', 'grad norm')[k]} differs from the uninterrupted run by {diff:.2e}"
    for plan, size in {"ep2": 2, **RESUMED}.items():  # every expert held, each rank a contiguous run of them
        held = [r[f"{plan}/experts"] for r in results]
        runs = [list(range(k, k + size)) for k in range(0, 4, size)]
        assert all(h in runs for h in held) and all(run in held for run in runs), (plan, held)


def _train(rank: int, world_size: int, argv: list[str]) -> int:
    from galva_models.cli.config import parse_train_config
    from galva_models.cli.train import run

    return run(parse_train_config(argv, world_size=world_size))


@pytest.mark.distributed
def test_galva_train_takes_a_config_directory_of_a_family_no_galva_file_names(tmp_path):
    """``galva-train --model-config DIR`` for a family Galva's sources never mention (internlm3): its tables are
    enough, under Megatron-SP x pp2 and under Ulysses with vocabulary sp."""
    import json

    _config("internlm3").save_pretrained(tmp_path / "cfg")
    common = ["--model-config", str(tmp_path / "cfg"), "--fp32", "--global-batch-size", "8", "--chunks", "2",
              "--seq-length", "16", "--no-progress", "--train-iters", "3"]  # fmt: skip
    plans = [["--pp", "2", "--tp", "2", "--sequence-parallel", "--vocab-tp", "2"], ["--tp", "2", "--ulysses"]]
    for k, plan in enumerate(plans):
        metrics = tmp_path / f"m{k}.jsonl"
        assert run_distributed(_train, 4, [*common, *plan, "--metrics-jsonl", str(metrics)], timeout=600) == [0] * 4
        losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
        assert len(losses) == 3 and all(loss == loss for loss in losses)


# ------------------------------------------------------------------------- encoder families from Galva's tables
ENCODER_PLANS = {
    "bert": ["tp2", "tp2-megatron_sp", "ulysses2", "pp2-zero3", "pp2-mixed"],
    # one label per image: vocabulary sp is refused (below), so Ulysses runs with the classifier split over labels
    "vit": ["tp2", "tp2-megatron_sp", "ulysses2-vtp2", "pp2-zero3", "pp2-mixed"],
    # window attention on a shifted, padded grid, patch merging between the stages; Ulysses and cp are refused
    "swin": ["tp2", "tp2-megatron_sp", "pp2-zero3", "pp2-mixed-sp"],
}
PLANS["ulysses2-vtp2"] = _plan([{"tp": 2, "ulysses": True}] * 4, vocab={"tp": 2})
PLANS["pp2-mixed-sp"] = _plan(  # a different form per layer under Megatron-SP: the sequence sliced where tp is 2
    [
        {"dp_type": "zero3"},
        {"tp": 2, "checkpoint": True},  # Swin: the stage's last block, its patch merging on sequence slices
        {"tp": 2, "tp_consecutive": False, "checkpoint": True},
        {"tp": 2, "dp_type": "zero2"},
    ],
    pp=2,
    megatron_sp=True,
    vocab={"tp": 2},
)


def encoder_config(family: str):
    """``tiny-bert``; ``tiny-vit`` on 12-pixel images (9 patches + CLS = 10 tokens: a 2-way sequence split divides
    them; the preset's 17 tokens do not, which the constraints refuse); ``tiny-swin`` as two stages of two blocks
    (4 layers, the second of each stage's windows shifted) on a 12 x 12 grid of 4 x 4 windows, merged into a 6 x 6
    grid the windows do not tile (Hugging Face pads it)."""
    config = preset_config(f"tiny-{family}")
    if family == "vit":
        config.image_size = 12
    if family == "swin":
        config.image_size, config.window_size, config.depths, config.num_heads = 24, 4, [2, 2], [2, 4]
        config.num_layers = 2
    return config


def check_encoders(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[str, tuple[float, float]]:
    from galva_models import adapter_for

    def batches(family: str, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        config = encoder_config(family)
        return task_batches(config, adapter_for(config).task.value, seq=seq, steps=STEPS)

    def reference(key: tuple[str, int]) -> tuple[list[float], list[float]]:
        config = encoder_config(key[0])
        torch.manual_seed(0)
        return hugging_face_task_run(adapter_for(config).build_model(config), batches(*key))

    runs = _runs(cases)
    refs = shared_references(list(runs), reference)  # as in check()
    out = {}
    for (family, seq), chosen in runs.items():
        adapter = adapter_for(encoder_config(family))
        for plan in chosen:
            torch.manual_seed(0)
            layered = adapter.decompose(adapter.build_model(encoder_config(family)))
            losses, norms = plan_run(layered, {**PLANS, **CP_PLANS}[plan], batches=batches(family, seq), seq_len=seq)
            if rank == 0:
                ref = refs[family, seq]
                out[f"{family}/{plan}"] = (_rel(losses, ref[0]), _rel(norms, ref[1]))
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_encoder_families_train_like_hugging_face():
    """BERT (masked LM), ViT and Swin (image classification) from Galva's tables, no adapter class: tp2,
    Megatron-SP, Ulysses 2 (not Swin: refused below), pp2 x ZeRO-3 and a mixed per-layer plan, 3 steps within 1e-5
    of Hugging Face + AdamW."""
    cases = [(family, plan) for family, plans in ENCODER_PLANS.items() for plan in plans]
    results = launch(check_encoders, cases)
    assert sorted(results[0]) == sorted(f"{f}/{p}" for f, p in cases)
    _assert(results)


def test_an_encoder_form_that_cannot_run_is_refused_in_one_line():
    """Vocabulary sp for a per-image label, a sequence split of ViT's 17 tokens, Ulysses and cp for Swin, and
    Megatron-SP where a Swin grid does not divide: refused up front by the constraints the search plans with."""
    from galva_models import adapter_for

    vit = preset_config("tiny-vit")
    constraints = adapter_for(vit).constraints(vit)
    problems = plan_problems(PLANS["ulysses2"], constraints, world_size=4, seq_len=SEQ)
    assert problems and all("\n" not in p for p in problems)
    assert any("vit scores one label per image" in p for p in problems), problems
    problems = plan_problems(PLANS["tp2-megatron_sp"], constraints, world_size=4, seq_len=SEQ)
    assert problems and all("\n" not in p for p in problems)
    assert any("17" in p for p in problems), problems
    swin = encoder_config("swin")  # Swin's layers read the whole grid: Ulysses and cp, one line per stage
    reason = "swin's layers arrange their {} tokens as a grid of windows outside the attention function"
    for plan in ("tp2-megatron_sp", "pp2-mixed-sp"):  # Megatron-SP gathers the grid around the windows
        assert not plan_problems(PLANS[plan], adapter_for(swin).constraints(swin), world_size=4), plan
    swin.image_size = 20  # a 10 x 10 grid merged into 5 x 5: its 25 tokens do not split in two
    problems = plan_problems(PLANS["tp2-megatron_sp"], adapter_for(swin).constraints(swin), world_size=4)
    assert problems and all("\n" not in p for p in problems), problems
    assert problems[0] == "layers[1].tp: Megatron-SP degree 2 does not divide the 25 tokens of its output", problems
    swin.image_size = 24
    for plan, form in (("ulysses2-vtp2", "Ulysses"), ("cp2", "context")):
        problems = plan_problems({**PLANS, **CP_PLANS}[plan], adapter_for(swin).constraints(swin), world_size=4)
        assert len(problems) >= 2 and all("\n" not in p for p in problems), problems  # cp: the vocabulary too
        assert form in problems[0] and reason.format(144) in problems[0], problems
        assert problems[1].startswith("layers[2..3]") and reason.format(36) in problems[1], problems


def test_galva_train_takes_context_parallelism_as_a_flag_and_refuses_what_does_not_fit():
    from galva_models.cli.config import parse_train_config
    from galva_models.cli.errors import ConfigError

    common = ["--model", "tiny-llama", "--fp32", "--seq-length", "64", "--chunks", "2", "--global-batch-size", "8"]
    flags = ["--tp", "2", "--sequence-parallel", "--context-parallel-size", "2"]
    cfg = parse_train_config([*common, *flags], world_size=8)
    assert {(layer.tp, layer.cp) for layer in cfg.strategy.layers} == {(2, 2)} and cfg.strategy.vocab.cp == 2
    assert cfg.strategy.layer_dp(0) == 2
    with pytest.raises(ConfigError, match=r"^--tp 2 x --cp 4 is more than the 4 ranks of a pipeline stage$"):
        parse_train_config([*common, "--tp", "2", "--cp", "4"], world_size=4)
    with pytest.raises(ConfigError, match=r"layers\[0\.\.3\]\.cp: the sequence of 60 tokens does not divide"):
        parse_train_config([*common[:-5], "60", "--cp", "4", "--chunks", "2", "--global-batch-size", "8"], world_size=4)


@pytest.mark.distributed
def test_a_reference_strategy_with_context_parallelism_converts_and_trains(tmp_path):
    """A reference ``galvatron_config`` whose ``cp_sizes_enc`` gives the layers cp 2 and 4 (with tp 2 on one, and
    ``vcp`` 2) trains through galva-train: its first loss is Hugging Face's on the same batch (an attention that
    missed the rest of the sequence would not be)."""
    import json

    from transformers import AutoModelForCausalLM

    from galva_ckpt.convert import hf_to_galva
    from galva_models.cli.config import parse_train_config
    from galva_models.cli.train import make_source
    from galva_models.presets import preset_config

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    model.save_pretrained(tmp_path / "hf")
    hf_to_galva(tmp_path / "hf", tmp_path / "g", progress=False)
    reference = {"pp_deg": 1, "tp_sizes_enc": "1,2,1,1", "dp_types_enc": "0,0,0,0", "global_bsz": 8, "chunks": 2,
                 "cp_sizes_enc": "4,2,2,1", "vcp": 2}  # fmt: skip
    (tmp_path / "galvatron_config.json").write_text(json.dumps(reference))
    argv = ["--load", str(tmp_path / "g"), "--galvatron-config-path", str(tmp_path / "galvatron_config.json"),
            "--fp32", "--seq-length", "64", "--no-progress", "--train-iters", "1"]  # fmt: skip
    metrics = tmp_path / "m.jsonl"
    assert run_distributed(_train, 4, [*argv, "--metrics-jsonl", str(metrics)], timeout=600) == [0] * 4
    batch = make_source(parse_train_config(argv, world_size=4)).batch(0)
    with torch.no_grad():
        logits = model.eval()(input_ids=batch.inputs).logits
        expected = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()))
    loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert abs(loss - expected) / expected < TOL, (loss, expected)


# ------------------------------------------------------------------ families beyond the list (no model run but one)
# Every transformers config class with tables gets a tiny config whose per-layer fields follow the layer count; a
# family whose layers read other tokens outside the attention function (linear attention, lightning attention, a mask
# from activations) is refused the sequence forms in one line by constraints(config), naming family and layer kind.


def _constraints(config):
    from galva_models.tables.adapter import constraints

    return constraints(config)


def _families_with_tables() -> list[str]:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = []
    for model_type, name in CONFIG_MAPPING_NAMES.items():
        cls = getattr(transformers, name, None)
        if getattr(cls, "base_model_tp_plan", None) and getattr(cls, "base_model_pp_plan", None):
            out.append(model_type)
    return out


def test_every_family_with_tables_has_a_tiny_config_holding_every_layer_kind():
    from transformers import CONFIG_MAPPING

    families = _families_with_tables()
    assert len(families) > 100
    for family in families:
        full = CONFIG_MAPPING[family]()
        kinds = {k: set(map(repr, v)) for k, v in per_layer_lists(full).items()}
        tiny = tiny_config(family)
        layers = tiny.num_hidden_layers
        assert 1 <= layers <= 4, family
        lists = per_layer_lists(tiny)
        assert set(lists) == set(kinds), f"{family}: per-layer fields {sorted(kinds)} -> {sorted(lists)}"
        for field, values in lists.items():
            if len(kinds[field]) <= layers and "size" not in field and "heads" not in field:
                assert set(map(repr, values)) == kinds[field], f"{family}.{field}: {values} lost a kind"
        if tiny.is_heterogeneous:  # overrides renumbered into the tiny layers
            assert max(tiny._heterogeneity_spec.per_layer_overrides) < layers, family


def _refusals(family: str, plan: str) -> list[str]:
    return plan_problems(PLANS[plan], _constraints(tiny_config(family)), world_size=4, seq_len=SEQ)


def test_a_layer_reading_tokens_outside_attention_is_refused_the_sequence_forms_in_one_line():
    # qwen3_5_text: gated delta-net layers (linear_attn) beside full attention; its tp table gathers their output
    for plan in ("ulysses2", "tp2-megatron_sp"):
        problems = _refusals("qwen3_5_text", plan)
        assert problems and all("\n" not in p for p in problems), plan
        assert "qwen3_5_text's linear_attention layers read other tokens outside the attention function" in problems[0]
        assert "(linear_attn)" in problems[0] and "layers[0..2]" in problems[0]
    assert _refusals("qwen3_5_text", "tp2") == []
    # minimax: lightning attention under the same module name as the softmax attention of its other layers
    assert "minimax's linear_attention layers" in _refusals("minimax", "ulysses2")[0]
    assert _refusals("minimax", "pp2-mixed") == []
    # doge: its attention mask is computed from the layer's values, on a slice under Ulysses
    assert "doge's token-mixing layers" in _refusals("doge", "ulysses2")[0]
    # axk2: a sparse-attention indexer picks keys by top-k (no gradient) from the layer's own tokens
    assert "axk2's indexed_attention layers" in _refusals("axk2", "ulysses2")[0]
    # a plain family and a windowed one keep every form
    for family in ("llama", "gemma2"):
        assert all(_refusals(family, plan) == [] for plan in ("ulysses2", "tp2-megatron_sp")), family


MORE = [
    ("minimax", "tp2"),
    ("minimax", "pp2-mixed"),
    ("deepseek_v2", "ulysses2"),
    ("doge", "pp2-zero3"),
    ("granite_swa", "ulysses2"),
    ("beam", "ulysses2"),
    ("dots1", "ep2-etp2"),
    ("inkling_text", "tp2"),
    ("qwen3_5_text", "tp2"),
]
"""The most different of the new families, each under a form it takes: a hybrid of lightning and softmax attention
with experts (tp, and a different form per layer over two stages), latent attention under Ulysses, a family with an
optional router left out, attention sinks (one per head) under Ulysses, a per-position query scale the model's
forward computes for the whole sequence (Beam's ``attention_scaling``, cut to the rank's positions) under Ulysses,
a mixture of experts whose routing leaves a rank's experts no token (Dots1 under ep2 x etp2), a token table
whose own forward norms its rows (Inkling's ``embed_norm``, whose gradient vocabulary tp sums), and a gated
delta-net whose input and output projections both gather (Qwen 3.5's linear attention under tp)."""


@pytest.mark.distributed
def test_families_beyond_the_list_train_like_hugging_face():
    _assert(launch(check, MORE))
