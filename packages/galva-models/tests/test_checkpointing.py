"""galva-train --save / --load: resuming under another plan, a save killed half-way, HF -> train -> HF round trips.

Every run is the real ``galva-train`` (``parse_train_config`` + ``run``) on 4 forked gloo ranks (fp32).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from galva_ckpt.checkpoint import CheckpointReader
from galva_ckpt.convert import galva_to_hf, hf_to_galva
from galva_ckpt.errors import CheckpointError
from galva_ckpt.sources import resolve
from galva_comm.testing import free_port, run_distributed
from galva_models.cli.config import ConfigError, parse_train_config

STALLED_SAVE = str(Path(__file__).with_name("_stalled_save.py"))  # galva-train whose save of a step stops half way
COMMON = ["--fp32", "--global-batch-size", "4", "--chunks", "2", "--seq-length", "16", "--no-progress"]
PLAN_A = ["--pp", "2", "--tp", "1", "--default-dp-type", "ddp"]  # 2 stages, dp 2 replicated
PLAN_B = ["--pp", "1", "--tp", "2", "--vocab-tp", "2", "--sdp"]  # 1 stage, tp 2, dp 2 ZeRO-3


def common_with(plan: list[str]) -> list[str]:
    """COMMON followed by ``plan``; a plan that sets its own --chunks replaces COMMON's (a flag is given once)."""
    if "--chunks" not in plan:
        return [*COMMON, *plan]
    at = COMMON.index("--chunks")
    return [*COMMON[:at], *COMMON[at + 2 :], *plan]


def _train(rank: int, world: int, argv: list[str]) -> int:
    from galva_models.cli.config import parse_train_config
    from galva_models.cli.train import run

    return run(parse_train_config(argv, world_size=world))


def galva_train(argv: list[str], world: int = 4) -> None:
    codes = run_distributed(_train, world, [str(a) for a in argv], timeout=120)
    assert codes == [0] * world


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_resume_under_another_plan_continues_the_run(tmp_path):
    """6 steps under B == 3 under B, save, 3 more under A (1e-5) or under B again (bit-identical). GPT-2 ties its
    word table and head: under B both holders are on one rank, which saves the tied weight's AdamW moments, its
    owner's (the embedding's; the head's holder has none); under A one holder per stage."""
    run = ["--model", "tiny-gpt2", *COMMON, "--train-iters", "6"]
    galva_train([*run, *PLAN_B, "--metrics-jsonl", tmp_path / "full.jsonl"])
    galva_train([*run, *PLAN_B, "--save", tmp_path / "b", "--save-interval", "3", "--exit-interval", "3"])
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["step-00000003"]
    resumed = ["--load", tmp_path / "b", *COMMON, "--train-iters", "6"]
    galva_train([*resumed, *PLAN_A, "--metrics-jsonl", tmp_path / "a.jsonl"])
    galva_train([*resumed, *PLAN_B, "--metrics-jsonl", tmp_path / "b2.jsonl"])
    full = losses(tmp_path / "full.jsonl")
    assert len(full) == 6
    assert losses(tmp_path / "b2.jsonl") == full[3:]  # same plan: bit-identical
    other = losses(tmp_path / "a.jsonl")
    assert len(other) == 3
    assert max(abs(a - b) for a, b in zip(other, full[3:])) < 1e-5


def test_keep_last_and_finetune(tmp_path):
    run = ["--model", "tiny-gpt2", *COMMON, *PLAN_B, "--train-iters", "3", "--save", tmp_path / "s"]
    galva_train([*run, "--save-interval", "1", "--keep-last", "2"])
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["step-00000002", "step-00000003"]
    galva_train(["--load", tmp_path / "s", "--finetune", *COMMON, *PLAN_A, "--train-iters", "1",
                 "--metrics-jsonl", tmp_path / "ft.jsonl", "--save", tmp_path / "ft"])  # fmt: skip
    assert len(losses(tmp_path / "ft.jsonl")) == 1  # weights only: the run starts at step 0
    manifest = CheckpointReader(tmp_path / "ft" / "step-00000001").manifest
    assert manifest.step == 1 and manifest.optimizer is not None and manifest.optimizer.step == 1


def test_the_runs_tokenizer_is_saved_and_exported(tmp_path):
    """A run whose --model-config directory holds a tokenizer keeps it in every save; a run resumed from that save
    keeps it too; g2h of the --save directory (its newest save) writes it back for AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from galva_models.presets import preset_config

    preset_config("tiny-llama").save_pretrained(tmp_path / "model")
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path / "model")
    galva_train(["--model-config", tmp_path / "model", *COMMON, "--train-iters", "1", "--save", tmp_path / "s"], 1)
    longer = ["--train-iters", "2", "--override-lr-schedule"]  # the saved run's schedule ended at step 1
    galva_train(["--load", tmp_path / "s", *COMMON, *longer, "--save", tmp_path / "r"], 1)
    for root, step in ((tmp_path / "s", 1), (tmp_path / "r", 2)):
        manifest = CheckpointReader(root / f"step-{step:08d}").manifest
        assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest.hf_files), manifest.hf_files
        galva_to_hf(resolve(root), tmp_path / f"hf-{root.name}", progress=False)
        out = tmp_path / f"hf-{root.name}"
        assert AutoTokenizer.from_pretrained(out, local_files_only=True)("hello world")["input_ids"] == [1, 2]
        assert (out / "tokenizer.json").read_bytes() == (tmp_path / "model" / "tokenizer.json").read_bytes()
        AutoModelForCausalLM.from_pretrained(out, local_files_only=True)


def test_a_save_killed_half_way_leaves_the_previous_one(tmp_path, capsys):
    root = tmp_path / "saves"
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    argv = ["--model", "tiny-llama", "--fp32", "--global-batch-size", "2", "--seq-length", "16", "--no-progress",
            "--train-iters", "3", "--save", str(root), "--save-interval", "1"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, STALLED_SAVE, "2", *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 600  # a guard against a hang, not a timing: a loaded machine starts slowly
        while not list(root.glob("step-00000002.tmp-*/optimizer/*.safetensors")):
            assert proc.poll() is None and time.time() < deadline, "the run ended before its second save"
            time.sleep(0.05)
        time.sleep(0.5)  # the tensors are written; the save waits before its checksums and manifest
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    capsys.readouterr()
    assert resolve(root) == root / "step-00000001"
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "ignoring incomplete save" in warning[0] and "step-00000002.tmp-" in warning[0]
    assert CheckpointReader(root / "step-00000001").verify_all()
    galva_train(["--load", root, *COMMON, *PLAN_B, "--train-iters", "3", "--metrics-jsonl", tmp_path / "r.jsonl"])
    assert len(losses(tmp_path / "r.jsonl")) == 2  # continued from step 1


SCHEDULE = ["--lr-warmup-iters", "1", "--lr-decay-style", "linear"]  # --min-lr 0: linear decay ends at lr 0.0


def test_a_resume_repeats_the_schedule_unless_overridden_and_keeps_the_precision(tmp_path, capsys):
    """An fp32 run of 4 steps saved; resumed with --train-iters 8 it is refused in one line naming the flag, the
    saved and the given value (a default that differs too), before any process group. With Megatron's override flag
    the new schedule runs from step 4: the learning rates equal an uninterrupted 8-step run's (the first resumed one
    is not the old schedule's end, 0.0). A resume given plan flags keeps the checkpoint's fp32 unless told --bf16."""
    from galva_models.cli.train import main as train_main

    run = ["--model", "tiny-llama", "--global-batch-size", "2", "--seq-length", "16", "--no-progress", *SCHEDULE]
    galva_train([*run, "--fp32", "--train-iters", "4", "--save", tmp_path / "s"], 1)
    galva_train([*run, "--fp32", "--train-iters", "8", "--metrics-jsonl", tmp_path / "full.jsonl"], 1)
    resume = ["--load", str(tmp_path / "s"), "--global-batch-size", "2", "--seq-length", "16", "--no-progress"]
    capsys.readouterr()
    for extra, needles in (
        ([*SCHEDULE, "--train-iters", "8"], ["--train-iters 8 differs from the 4", "--override-lr-schedule"]),
        (["--train-iters", "4", "--lr-warmup-iters", "1"], ["--lr-decay-style cosine (the default) differs from the"]),
    ):
        assert train_main([*resume, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("galva-train: error: ") and "Traceback" not in err, err
        assert all(needle in err for needle in needles), err
    assert parse_train_config([*resume, *SCHEDULE, "--train-iters", "4"], 1).strategy.mixed_precision.value == "fp32"
    cfg = parse_train_config([*resume, *SCHEDULE, "--train-iters", "8", "--override-lr-schedule", "--bf16"], 1)
    assert cfg.strategy.mixed_precision.value == "bf16"  # given explicitly
    cfg = parse_train_config([*resume, *SCHEDULE, "--train-iters", "8", "--override-opt_param-scheduler"], 1)
    assert cfg.strategy.mixed_precision.value == "fp32"
    assert any("fp32 kept from --load" in note for note in cfg.plan_overrides), cfg.plan_overrides

    galva_train([*resume, *SCHEDULE, "--train-iters", "8", "--override-opt_param-scheduler",
                 "--metrics-jsonl", tmp_path / "resumed.jsonl"], 1)  # fmt: skip
    full = [json.loads(line)["lr"] for line in (tmp_path / "full.jsonl").read_text().splitlines()]
    resumed = [json.loads(line)["lr"] for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert resumed == full[4:] and resumed[0] > 0.0, (resumed, full)


THREE_PLANS = [  # pp2 x tp2 (vocab tp2), ZeRO-3 over 4 ranks, pp2 x Ulysses 2
    ["--pp", "2", "--tp", "2", "--vocab-tp", "2"],
    ["--sdp", "--chunks", "1"],
    ["--pp", "2", "--tp", "2", "--ulysses"],
]
# T5 (tiny-t5: 2 + 2 layers): --pp 4 puts every layer on its own stage, so each stack's shared relative-position table
# lives on two stages (saved from its home layer's stage, loaded there and broadcast to the other); then tp 2 with
# dp 2 ZeRO-3 (one micro-batch: T5's vocabulary modules stay at tp 1), then pp 2 with Ulysses 2
T5_PLANS = [
    ["--pp", "4"],
    ["--tp", "2", "--default-dp-type", "zero3", "--chunks", "1"],
    ["--pp", "2", "--tp", "2", "--ulysses"],
]
# ViT's 16 patches and a class token (17) divide over no Ulysses degree: pp2 x tp2, ZeRO-3, then tp 4 (vocab tp 4)
VIT_PLANS = [*THREE_PLANS[:2], ["--tp", "4", "--vocab-tp", "4"]]
# Swin's layers read the whole patch grid (no sequence form) and its first stages have 2 heads: then tp 2 x dp 2
SWIN_PLANS = [*THREE_PLANS[:2], ["--tp", "2", "--vocab-tp", "2"]]
ROUND_TRIP = {
    "llama": THREE_PLANS,
    "gpt2": THREE_PLANS,
    "bert": THREE_PLANS,
    "t5": T5_PLANS,
    "vit": VIT_PLANS,
    "swin": SWIN_PLANS,
}
SLOW_ROUND_TRIP = {"bert", "swin", "vit"}  # 16-45 s each on a 2-core machine (t5: 12-20 s)
# mistral, qwen2 and every other family run from its tables: test_tables.py round-trips each of them


def _tiny_hf(family: str, directory: Path) -> torch.nn.Module:
    from galva_models import adapter_for
    from galva_models.presets import preset_config

    config = preset_config(f"tiny-{family}")
    torch.manual_seed(5)
    model = adapter_for(config).build_model(config, attn_implementation="sdpa")
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a swapped tensor
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(directory)
    return model


def round_trip_argv(source: Path, plan: list[str], task: object) -> list[str]:
    """``--load source`` with COMMON and ``plan``; an image family takes no --seq-length (the image fixes it)."""
    argv = ["--load", source, *common_with(plan)]
    if task.value == "image_classification":
        at = argv.index("--seq-length")
        argv = argv[:at] + argv[at + 2 :]
    return argv


def hugging_face_first_loss(hf: torch.nn.Module, argv: list[str]) -> float:
    """The Hugging Face model's loss on the first global batch galva-train draws for ``argv`` (its ``make_source``),
    computed the way the task's Galva head computes it."""
    from galva_models.cli.train import make_source
    from galva_models.tables.family import Task

    cfg = parse_train_config([str(a) for a in argv], world_size=4)
    batch = make_source(cfg).batch(0)
    with torch.no_grad():
        if cfg.task is Task.CAUSAL_LM:  # galva-train's labels are already shifted: no second shift
            logits = hf.eval()(input_ids=batch.inputs).logits
            return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()))
        if cfg.task is Task.SEQ2SEQ_LM:  # inputs = [encoder ids ; labels shifted right]: HF shifts them itself
            return float(hf.eval()(input_ids=batch.inputs[:, : cfg.seq_length], labels=batch.labels).loss)
        if cfg.task is Task.MASKED_LM:
            return float(hf.eval()(input_ids=batch.inputs, labels=batch.labels).loss)
        return float(hf.eval()(pixel_values=batch.inputs, labels=batch.labels).loss)


def auto_class(task: object) -> type:
    """The ``transformers`` Auto class that loads a checkpoint of ``task`` with its head."""
    import transformers

    return getattr(transformers, {
        "causal_lm": "AutoModelForCausalLM",
        "masked_lm": "AutoModelForMaskedLM",
        "seq2seq_lm": "AutoModelForSeq2SeqLM",
        "image_classification": "AutoModelForImageClassification",
    }[task.value])  # fmt: skip


def on_disk(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state (tied aliases included) under the names Hugging Face writes to disk, which a Galva checkpoint
    uses (transformers 5 renames some in memory: ViT's and Swin's attention)."""
    from transformers.core_model_loading import revert_weight_conversion

    params = dict(model.named_parameters(remove_duplicate=False))
    return revert_weight_conversion(model, {**params, **model.state_dict()})


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_ROUND_TRIP else f for f in sorted(ROUND_TRIP)]
)
def test_hugging_face_round_trip_under_three_plans(tmp_path, family):
    """HF -> h2g -> galva-train --load (3 plans; first loss == HF's) -> save -> g2h -> from_pretrained == saved."""
    from galva_models import adapter_for

    hf = _tiny_hf(family, tmp_path / "hf")
    task = adapter_for(hf.config).task
    hf_to_galva(tmp_path / "hf", tmp_path / "g", progress=False)
    for k, plan in enumerate(ROUND_TRIP[family]):
        source = tmp_path / ("g" if k != 1 else "hf")  # h2g output, and the Hugging Face directory itself
        argv = round_trip_argv(source, plan, task)
        reference = hugging_face_first_loss(hf, argv)
        out = tmp_path / f"run{k}"
        galva_train([*argv, "--train-iters", "2", "--save", out, "--metrics-jsonl", tmp_path / f"m{k}.jsonl"])
        first = losses(tmp_path / f"m{k}.jsonl")[0]
        assert abs(first - reference) < 1e-5, (plan, first, reference)
        galva_to_hf(out / "step-00000002", tmp_path / f"back{k}", progress=False)
        back = auto_class(task).from_pretrained(tmp_path / f"back{k}", local_files_only=True)
        reader = CheckpointReader(out / "step-00000002")
        saved = {n: t for m in reader.module_names for n, t in reader.read_module(m).items()}
        state = on_disk(back)
        for name, tensor in saved.items():
            assert torch.equal(state[name], tensor), name
        assert set(saved) | set(reader.manifest.tied) >= {n for n in state if not n.endswith("rotary_emb.inv_freq")}


def test_loading_another_model_or_a_damaged_file_is_one_line(tmp_path):
    _tiny_hf("gpt2", tmp_path / "gpt2")
    argv = ["--model", "tiny-llama", *COMMON, "--train-iters", "1", "--load", tmp_path / "gpt2"]
    with pytest.raises(ConfigError) as info:  # refused before any rank starts: the checkpoint's family is checked
        parse_train_config([str(a) for a in argv], world_size=2)
    message = str(info.value)
    assert message.count("\n") == 0 and "a gpt2 checkpoint, but --model tiny-llama is a llama model" in message
    galva_train(["--model", "tiny-llama", *COMMON, *PLAN_B, "--train-iters", "1", "--save", tmp_path / "s"])
    layer = tmp_path / "s" / "step-00000001" / "model" / "layers.1.safetensors"
    data = bytearray(layer.read_bytes())
    data[-4:] = b"\0\0\0\0"
    layer.write_bytes(bytes(data))
    argv = ["--model", "tiny-llama", *COMMON, "--train-iters", "1", "--load", tmp_path / "s"]  # the saved schedule
    message = run_distributed(_load_error, 2, [str(a) for a in argv], timeout=60)[0]
    assert message.count("\n") == 0 and "layers.1.safetensors: checksum mismatch" in message, message
    bigger = ["--model", "tiny-llama", "--hidden-size", "128", *COMMON, "--train-iters", "1", "--load", tmp_path / "s"]
    with pytest.raises(CheckpointError):
        resolve(tmp_path / "nowhere")
    message = run_distributed(_load_error, 2, [str(a) for a in bigger], timeout=60)[0]
    assert message.count("\n") == 0 and "embedding.safetensors: tensor model.embed_tokens.weight is [" in message


def _load_error(rank: int, world: int, argv: list[str]) -> str:
    import contextlib
    import io

    from galva_models.cli.config import parse_train_config
    from galva_models.cli.train import run

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run(parse_train_config(argv, world_size=world))
    assert code == 2
    # the start-of-run banner line comes first; the failure is the one error line after it
    errors = [line for line in err.getvalue().splitlines() if line.startswith("galva-train: error:")]
    return "\n".join(errors) if rank == 0 else ""
