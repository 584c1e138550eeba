"""galva-train's argument surface: parsing into a TrainConfig, and one-line errors before any process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from galva_models.cli.config import ConfigError, parse_train_config
from galva_models.cli.train import main as train_main
from galva_schema import Strategy


def test_global_flags_and_megatron_aliases():
    cfg = parse_train_config(
        [
            "--model", "tiny-llama", "--num-layers", "6", "--pipeline-model-parallel-size", "2",
            "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--seq-length", "64", "--recompute-granularity", "full", "--bf16", "--lr", "3e-4", "--min-lr", "3e-5",
            "--lr-warmup-iters", "5", "--train-iters", "20", "--clip-grad", "0", "--seed", "7",
        ],
        world_size=8,
    )  # fmt: skip
    s = cfg.strategy
    assert (s.pp, s.num_layers, s.global_batch_size, s.world_size) == (2, 6, 8, 8)
    assert all(layer.tp == 2 and layer.checkpoint for layer in s.layers)
    assert s.num_micro_batches == 2  # 8 = micro 2 x dp 2 x 2 micro-batches
    assert s.mixed_precision.value == "bf16" and cfg.optim.clip_grad is None and cfg.optim.warmup_iters == 5
    assert cfg.model_config.num_hidden_layers == 6 and len(cfg.layer_specs) == 6 and cfg.seed == 7


def test_megatron_expert_flags():
    """Megatron-LM's expert flags (and Galva's short spellings) give every layer its expert layout; a model without
    experts, or a layout that does not split them, is refused in one line before any process group."""
    argv = ["--model", "tiny-mixtral", "--seq-length", "16", "--fp32", "--tp", "2"]
    cfg = parse_train_config(
        [*argv, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2", "--expert-dp-type", "zero3"],
        world_size=4,
    )
    assert {(layer.ep, layer.etp, layer.expert_dp_type) for layer in cfg.strategy.layers} == {(2, 2, "zero3")}
    assert parse_train_config([*argv, "--ep", "4"], world_size=4).strategy.layers[0].ep == 4
    with pytest.raises(ConfigError, match=r"^tiny-llama: layers\[0..3\].ep: tiny-llama has no expert layers$"):
        parse_train_config(["--model", "tiny-llama", "--ep", "2"], world_size=4)
    with pytest.raises(ConfigError, match="ep x etp = 4 x 2 does not divide the 4 ranks"):
        parse_train_config([*argv, "--ep", "4", "--etp", "2"], world_size=4)


def test_gqa_tp_beyond_kv_heads_is_accepted():
    # 4 query heads, 2 key/value heads, tp 4: galva-hp replicates one K/V head per rank
    cfg = parse_train_config(["--model", "tiny-llama", "--tp", "4", "--seq-length", "32"], world_size=4)
    assert cfg.strategy.layers[0].tp == 4


def test_strategy_file(tmp_path):
    path = tmp_path / "plan.json"
    Strategy.uniform(world_size=4, num_layers=4, global_batch_size=8, layer={"tp": 2}, pp=2).save(path)
    cfg = parse_train_config(["--model", "tiny-gpt2", "--strategy", str(path), "--seq-length", "32"], world_size=4)
    assert cfg.strategy.pp == 2 and cfg.global_batch_size == 8
    with pytest.raises(ConfigError, match="drop the global flag"):
        parse_train_config(["--model", "tiny-gpt2", "--strategy", str(path), "--tp", "2"], world_size=4)


def test_galvatron_config_file(tmp_path):
    path = tmp_path / "galvatron_config_llama.json"
    reference = {
        "pp_deg": 2, "tp_sizes_enc": "2,2,1,1", "tp_consecutive_flags": "1,1,1,1", "dp_types_enc": "0,0,1,1",
        "use_sp": "0,0,0,0", "checkpoint": "1,0,1,0", "global_bsz": 8, "chunks": 2, "pp_division": "2,2",
        "pipeline_type": "pipedream_flush", "default_dp_type": "zero2", "vtp": 2, "vsp": 0, "embed_sdp": 0,
    }  # fmt: skip
    path.write_text(json.dumps(reference))
    argv = ["--model", "tiny-llama", "--galvatron-config-path", str(path), "--seq-length", "32", "--fp32"]
    s = parse_train_config(argv, world_size=4).strategy
    assert [layer.tp for layer in s.layers] == [2, 2, 1, 1]
    assert [layer.checkpoint for layer in s.layers] == [True, False, True, False]
    assert s.layer_dp_type(3).value == "zero3" and s.vocab.tp == 2 and s.pipeline_schedule.value == "1f1b"
    with pytest.raises(ConfigError, match="tp_sizes_enc: the file has 4 layers, the model has 6"):
        parse_train_config([*argv, "--num-layers", "6"], world_size=4)


def test_model_config_directory(tmp_path):
    from galva_models.presets import preset_config

    preset_config("tiny-qwen2").save_pretrained(str(tmp_path))
    cfg = parse_train_config(["--model-config", str(tmp_path), "--hidden-size", "32", "--seq-length", "16"])
    assert cfg.model_config.model_type == "qwen2" and cfg.model_config.hidden_size == 32 and cfg.world_size == 1
    assert cfg.adapter.model_types == ()  # no adapter of its own: qwen2 runs from its tables


BAD = [
    (["--model", "tiny-llama", "--tp", "8"], 8, "tp 8 does not divide the 4 attention heads of llama layers"),
    (
        [
            "--model",
            "tiny-llama",
            "--hidden-size",
            "96",
            "--num-attention-heads",
            "6",
            "--num-query-groups",
            "3",
            "--tp",
            "2",
        ],
        2,
        "tp 2 and the 3 key/value heads of llama layers do not divide one another",
    ),
    (["--model", "gpt3-175b"], 1, "unknown model preset 'gpt3-175b'; known presets: gpt2-small, gpt2-medium"),
    (["--model", "tiny-gpt2", "--num-layers", "3", "--pp", "4"], 4, "--pp 4 is more than the model's 3 layers"),
    (["--model", "tiny-llama", "--tp", "2", "--ulysses", "--seq-length", "33"], 2, "Ulysses degree 2 does not divide"),
    (["--model", "tiny-gpt2", "--tp", "2", "--sequence-parallel", "--seq-length", "33"], 2, "Megatron-SP degree 2"),
    (["--model", "tiny-gpt2", "--seq-length", "1000"], 1, "exceeds the model's 256 learned positions"),
    (["--model", "tiny-llama", "--global-batch-size", "6"], 4, "cannot be split over data-parallel degree 4"),
    (["--model", "tiny-llama", "--fp16"], 1, "fp16 needs loss scaling"),
    (
        ["--model", "tiny-llama", "--tp", "two"],
        1,
        "argument --tp/--tensor-model-parallel-size/--global-tp-deg: invalid",
    ),
    (["--model", "tiny-llama", "--frobnicate"], 1, "unrecognized arguments: --frobnicate"),
    (["--model", "tiny-llama", "--attention-backend", "flash"], 1, "flash"),
    (["--model", "tiny-vit", "--seq-length", "64"], 1, "vit takes images"),
    (["--model", "tiny-llama", "--num-attention-heads", "3"], 1, "not divisible by --num-attention-heads 3"),
    (
        ["--model", "tiny-swin", "--tp", "4", "--sequence-parallel"],
        4,
        "layers[0].tp: tp 4 does not divide the 2 attention",
    ),
    (  # vocab tp runs on images (classifier split over the labels); vocab sp has no sequence to split
        ["--model", "tiny-vit", "--vocab-tp", "2", "--vocab-sp"],
        2,
        "vocab.sp: the vocabulary cannot run vocabulary sequence parallelism: vit scores one label per image",
    ),
    (
        ["--model", "tiny-t5", "--vocab-tp", "2"],
        2,
        "vocab.tp: the vocabulary cannot run vocabulary tensor parallelism: t5",
    ),
    (
        ["--model", "tiny-t5", "--tp", "8"],
        8,
        "layers[0..1].tp: tp 8 does not divide the 4 attention heads of t5_encoder",
    ),
    # flags that would otherwise be parsed and do nothing
    (["--model", "tiny-gpt2", "--sequence-parallel"], 2, "--sequence-parallel splits the sequence of tp layers"),
    (["--model", "tiny-llama", "--load", "no-such-ckpt"], 1, "--load: no-such-ckpt: no such directory"),
    (["--model", "tiny-llama", "--save-interval", "100"], 1, "--save-interval needs --save DIR"),
    (["--model", "tiny-llama", "--save", "c", "--keep-last", "2", "--save-interval", "0"], 1, "--save-interval must"),
    (["--model", "tiny-llama", "--finetune"], 1, "--finetune loads weights only from --load DIR"),
    (["--model", "tiny-llama", "--decoder-seq-length", "16"], 1, "--decoder-seq-length: llama has no decoder stream"),
    (["--model", "tiny-llama", "--log-interval", "0"], 1, "--log-interval must be >= 1, got 0"),
    (["--model", "tiny-llama", "--lr-decay-style", "inverse-square-root"], 1, "argument --lr-decay-style: invalid"),
    (
        ["--model", "tiny-llama", "--use-distributed-optimizer", "--default-dp-type", "ddp"],
        2,
        "--use-distributed-optimizer is zero2; it contradicts --default-dp-type ddp",
    ),
    (["--model", "tiny-llama", "--sdp", "--default-dp-type", "zero2"], 2, "--sdp is ZeRO-3 on every layer; it contra"),
    (["--model", "tiny-swin", "--ffn-hidden-size", "64"], 1, "--ffn-hidden-size: swin has no feed-forward size field"),
    (["--model", "tiny-gpt2", "--num-query-groups", "2"], 1, "--num-query-groups: gpt2 has no grouped-query attention"),
    (["--model", "tiny-swin", "--hidden-size", "64"], 1, "swin has per-stage sizes; use a --model-config"),
    (["--hf-checkpoint", "ckpt", "--num-layers", "2"], 1, "--num-layers: the weights come from --hf-checkpoint ckpt"),
    (["--model", "tiny-llama", "--hf-checkpoint", "ckpt"], 1, "argument --hf-checkpoint: not allowed with argument"),
]


@pytest.mark.parametrize(("argv", "world", "message"), BAD)
def test_bad_combinations_are_one_line_errors(argv, world, message):
    with pytest.raises(ConfigError) as info:
        parse_train_config(argv, world_size=world)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_plan_flags_next_to_a_plan_file_are_refused(tmp_path):
    path = tmp_path / "plan.json"
    Strategy.uniform(world_size=4, num_layers=4, global_batch_size=8, layer={"tp": 2}).save(path)
    with pytest.raises(ConfigError, match="--micro-batch-size: the plan comes from --strategy"):
        parse_train_config(["--model", "tiny-gpt2", "--strategy", str(path), "--micro-batch-size", "2"], world_size=4)


def test_embed_sdp_shards_the_vocabulary_layers():
    plain = parse_train_config(["--model", "tiny-gpt2", "--seq-length", "16"], world_size=2).strategy
    sharded = parse_train_config(["--model", "tiny-gpt2", "--seq-length", "16", "--embed-sdp"], world_size=2).strategy
    assert (plain.vocab_dp_type.value, sharded.vocab_dp_type.value) == ("ddp", "zero3")


def test_tensorboard_dir_needs_tensorboard(tmp_path):
    import importlib.util

    argv = ["--model", "tiny-gpt2", "--tensorboard-dir", str(tmp_path / "tb")]
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ConfigError, match="--tensorboard-dir: tensorboard is not installed"):
            parse_train_config(argv)
    else:
        assert parse_train_config(argv).tensorboard_dir == str(tmp_path / "tb")


def test_galva_train_and_galva_hp_report_the_same_problems(tmp_path):
    """One check of a plan against a model: galva-train's line (after its source prefix) is galva-hp's build error."""
    from galva_hp import check_plan
    from galva_models import build_layered
    from galva_models.presets import preset_config
    from galva_schema import SchemaError

    path = tmp_path / "plan.json"
    plan = Strategy.uniform(
        world_size=2, num_layers=4, global_batch_size=2, layer={"tp": 2}, default_dp_type="zero3", vocab={"tp": 2}
    )
    plan.save(path)
    with pytest.raises(ConfigError) as cli:
        parse_train_config(["--model", "tiny-t5", "--strategy", str(path), "--seq-length", "8"], world_size=2)
    _, layered = build_layered(preset_config("tiny-t5"), encoder_seq_length=8)
    with pytest.raises(SchemaError) as hp:
        check_plan(layered, plan, world_size=2, seq_len=8)
    cli_problems = str(cli.value).removeprefix(f"{path}: ")
    assert cli_problems == str(hp.value).removeprefix("strategy: ")
    assert "ZeRO-3" not in cli_problems  # the layers' shared tables are galva-hp shared parameters
    assert "vocab.tp: the vocabulary cannot run vocabulary tensor parallelism" in cli_problems


def test_t5_plans_use_every_dimension(tmp_path):
    # the stacks' relative-position tables are shared parameters (galva-hp): no stage, layout or ZeRO-3 restriction
    for argv, world in (
        (["--pp", "2", "--tp", "2", "--checkpoint"], 4),
        (["--pp", "4"], 4),
        (["--zero3"], 2),
        (["--tp", "2", "--sequence-parallel"], 2),
        (["--tp", "2", "--ulysses"], 2),
    ):
        cfg = parse_train_config(["--model", "tiny-t5", *argv], world_size=world)
        assert cfg.strategy.world_size == world, argv
    # a stack whose layers split the table differently, over two stages: accepted too
    path = tmp_path / "plan.json"
    layers = [{"tp": 2}, {"tp": 1}, {"tp": 2, "ulysses": True}, {"tp": 2}]
    plan = {"world_size": 4, "pp": 2, "pp_division": [1, 3], "global_batch_size": 8, "layers": layers}
    Strategy.model_validate(plan).save(path)
    assert parse_train_config(["--model", "tiny-t5", "--strategy", str(path)], world_size=4).strategy.pp == 2


def test_strategy_layer_count_mismatch(tmp_path, capsys):
    path = tmp_path / "plan.json"
    Strategy.uniform(world_size=2, num_layers=6, global_batch_size=4, pp=2).save(path)
    code = train_main(["--model", "tiny-llama", "--strategy", str(path), "--world-size", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err == f"galva-train: error: {path}: layers: the strategy has 6 layers but tiny-llama has 4"
    assert not dist.is_initialized()  # rejected before any process group


def test_cli_process_exits_nonzero_with_one_line(tmp_path):
    env = {**os.environ, "WORLD_SIZE": "4"}
    proc = subprocess.run(
        [sys.executable, "-m", "galva_models.cli.train", "--model", "tiny-llama", "--tp", "8"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.startswith("galva-train")]
    assert proc.returncode == 2 and len(lines) == 1
    assert "--tp 8 does not divide the 4 ranks of a pipeline stage" in lines[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_end_to_end_preprocess_then_torchrun(tmp_path, corpus_and_tokenizer):
    """galva-data preprocess, then galva-train on 4 CPU ranks (pp2 x tp2, checkpointing) for 30 steps."""
    corpus, tokenizer_dir, _ = corpus_and_tokenizer
    bindir = Path(sys.executable).parent
    prefix = tmp_path / "data" / "corpus"
    subprocess.run(
        [str(bindir / "galva-data"), "preprocess", "--input", str(corpus), "--tokenizer", str(tokenizer_dir),
         "--output-prefix", str(prefix), "--append-eod", "--workers", "2"],
        check=True, timeout=600,
    )  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run(
        [str(bindir / "torchrun"), "--nproc_per_node", "4", "--master-port", str(_free_port()),
         "-m", "galva_models.cli.train", "--model", "tiny-llama", "--pp", "2", "--tp", "2", "--checkpoint",
         "--global-batch-size", "8", "--chunks", "2", "--seq-length", "32", "--train-iters", "30", "--fp32",
         "--lr", "3e-3", "--lr-warmup-iters", "3", "--data-path", str(prefix), "--metrics-jsonl", str(metrics),
         "--no-progress", "--log-interval", "10"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))  # from 1, as the console and the checkpoints
    for key in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tflops", "peak_memory_mib"):
        assert all(isinstance(r[key], float) for r in records), key
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 0.5, (first, last)


def _free_port() -> int:
    from galva_comm.testing import free_port

    return free_port()


def test_attention_backend_selection():
    from galva_models.attention import AttentionBackendError, attn_implementation

    assert attn_implementation("sdpa") == "sdpa"
    with pytest.raises(AttentionBackendError, match=r"needs the flash-attn package|needs a CUDA device"):
        attn_implementation("flash")
    with pytest.raises(AttentionBackendError, match="unknown attention backend 'xformers'"):
        attn_implementation("xformers")


def test_hf_checkpoint_weights_are_loaded(tmp_path):
    import torch

    from galva_models import build_layered
    from galva_models.cli.train import build_model
    from galva_models.presets import preset_config

    torch.manual_seed(3)
    saved, _ = build_layered(preset_config("tiny-qwen2"))
    saved.save_pretrained(str(tmp_path))
    cfg = parse_train_config(["--hf-checkpoint", str(tmp_path), "--seq-length", "16", "--seed", "99"])
    _, layered = build_model(cfg)
    assert torch.equal(layered.layers[1].layer.self_attn.q_proj.bias, saved.model.layers[1].self_attn.q_proj.bias)
    assert torch.equal(layered.head.lm_head.weight, saved.lm_head.weight)
