"""Bad inputs and faults for galva-train, galva-data and galva-report (issue #12): each one ends with the expected
exit status and exactly one line on stderr naming the file, field or flag; never a traceback.

The commands run in-process through their ``main(argv)`` (everything here is refused before a process group
exists), which is what the console scripts call.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from galva_models.cli.data import main as data_main
from galva_models.cli.train import main as train_main
from galva_models.report import main as report_main
from galva_schema import Strategy

GPT2 = ["--model", "tiny-gpt2", "--seq-length", "16"]


def one_line(capsys: pytest.CaptureFixture[str], code: int, expected_code: int, *names: str) -> str:
    """Assert the exit status and one stderr line holding every name; return the line."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == expected_code, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def _dataset(prefix: Path, top: int = 100) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for i in range(8):
        builder.add_item(torch.arange(top - 64, top) - i)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _strategy(path: Path, **layer: object) -> Path:
    data = Strategy.uniform(world_size=1, num_layers=2, global_batch_size=2).to_dict()
    data["layers"] = [{**data["layers"][0], **layer}] * len(data["layers"])
    path.write_text(json.dumps(data))
    return path


TRAIN_FLAGS = [
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    (["--chunks", "0"], "--chunks must be >= 1, got 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["--pp-deg", "0"], "--pp-deg must be >= 1"),
    (["--num-micro-batches", "-2"], "--num-micro-batches must be >= 1"),
    (["--train-iters", "0"], "--train-iters must be >= 1"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--adam-beta2", "1"], "--adam-beta2 must be < 1"),
    (["--adam-eps", "0"], "--adam-eps must be > 0"),
    (["--collective-timeout", "0"], "--collective-timeout must be > 0"),
    (["--world-size", "0"], "--world-size must be >= 1"),
    (["--tp", "2", "--tensor-model-parallel-size", "1"], "--tensor-model-parallel-size 1 contradicts --tp 2"),
    (["--pp", "2", "--pp", "1"], "--pp 1 contradicts --pp 2"),
    (["--sdp", "--default-dp-type", "ddp"], "--sdp"),
    (["--use-distributed-optimizer", "--default-dp-type", "zero3"], "--use-distributed-optimizer"),
    (["--no-such-flag"], "--no-such-flag"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), TRAIN_FLAGS, ids=[" ".join(f) for f, _ in TRAIN_FLAGS])
def test_train_flag_out_of_range_or_contradictory(flags, message, capsys):
    line = one_line(capsys, train_main([*GPT2, *flags]), 2, message)
    assert line.startswith("galva-train: error: ")
    assert "_" not in line.split("error: ", 1)[1].split(" ")[0]  # a flag as typed, never a Python name


@pytest.mark.parametrize(
    ("layer", "field"), [({"tp": "2"}, "layers[0].tp"), ({"checkpoint": "yes"}, "layers[0].checkpoint")]
)
def test_train_strategy_file_values_are_not_coerced(tmp_path, layer, field, capsys):
    plan = _strategy(tmp_path / "plan.json", **layer)
    one_line(capsys, train_main([*GPT2, "--strategy", str(plan)]), 2, str(plan), field)


def test_train_truncated_bin(tmp_path, capsys):
    prefix = _dataset(tmp_path / "ds")
    os.truncate(f"{prefix}.bin", 100)
    one_line(capsys, train_main([*GPT2, "--data-path", prefix]), 2, "--data-path", f"{prefix}.bin", "truncated")


def test_train_truncated_idx(tmp_path, capsys):
    prefix = _dataset(tmp_path / "ds")
    os.truncate(f"{prefix}.idx", 20)
    one_line(capsys, train_main([*GPT2, "--data-path", prefix]), 2, f"{prefix}.idx")


def test_train_token_ids_beyond_the_vocabulary(tmp_path, capsys):
    prefix = _dataset(tmp_path / "ds", top=300)
    one_line(
        capsys, train_main([*GPT2, "--vocab-size", "128", "--data-path", prefix]), 2, f"{prefix}.bin", "token id 299"
    )


def test_train_hf_checkpoint_without_weights(tmp_path, capsys):
    from galva_models.presets import preset_config

    preset_config("tiny-gpt2").save_pretrained(tmp_path)
    one_line(capsys, train_main(["--hf-checkpoint", str(tmp_path)]), 2, "--hf-checkpoint", "no weights")


def test_train_model_of_one_family_with_a_checkpoint_of_another(tmp_path, capsys):
    from galva_models.presets import preset_config

    config = preset_config("tiny-llama")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    capsys.readouterr()  # the save's progress bar
    line = one_line(capsys, train_main([*GPT2, "--load", str(tmp_path / "llama")]), 2, "--load", "llama", "gpt2")
    assert "--model tiny-gpt2" in line


@pytest.mark.parametrize(
    ("flag", "target", "what"),
    [
        ("--metrics-jsonl", "/proc/galva-test/metrics.jsonl", "cannot write in /proc"),
        ("--metrics-jsonl", "{tmp}", "is a directory"),
        ("--metrics-jsonl", "/dev/full", "is not a regular file"),
        ("--report-html", "/proc/galva-test.html", "cannot write in /proc"),
        ("--save", "{tmp}/file", "is not a directory"),
    ],
)
def test_train_outputs_checked_before_the_first_step(tmp_path, flag, target, what, capsys):
    (tmp_path / "file").write_text("x")
    target = target.format(tmp=tmp_path)
    one_line(capsys, train_main([*GPT2, flag, target]), 2, f"{flag} {target}", what)


def test_data_bad_flags_and_outputs(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a b"}\n')
    base = ["preprocess", "--input", str(corpus), "--tokenizer", str(tmp_path)]
    one_line(capsys, data_main([*base, "--output-prefix", str(tmp_path / "o"), "--workers", "0"]), 2, "--workers")
    one_line(capsys, data_main([*base, "--output-prefix", "/proc/galva/ds"]), 2, "--output-prefix", "/proc")
    (tmp_path / "d.bin").mkdir()
    one_line(capsys, data_main([*base, "--output-prefix", str(tmp_path / "d")]), 2, "d.bin", "is a directory")
    with pytest.raises(SystemExit) as exit_info:
        data_main(["preprocess", "--input", str(corpus)])
    one_line(capsys, int(exit_info.value.code or 0), 2, "--tokenizer")
    out = ["--output-prefix", str(tmp_path / "o")]
    line = one_line(capsys, data_main([*base, *out]), 1, f"{tmp_path}: cannot load a tokenizer")  # transformers: 5
    assert not line.endswith(":"), line  # says what is missing, not the first line of a list cut off
    one_line(capsys, data_main(["preprocess", "--input", str(tmp_path), "--tokenizer", str(tmp_path), *out]), 1,
             f"{tmp_path}: is a directory")  # fmt: skip
    one_line(capsys, data_main(["preprocess", "--input", str(corpus), "--tokenizer", str(corpus), *out]), 1,
             f"{corpus}: is not a directory")  # fmt: skip
    assert not list(tmp_path.glob("o*")) and not list(tmp_path.glob(".o*"))


def _metrics(path: Path, losses: list[object], tail: str = "") -> Path:
    lines = [json.dumps({"step": i, "loss": loss, "lr": 1e-3, "tokens_per_s": 10.0})
             for i, loss in enumerate(losses, start=1)]  # fmt: skip
    path.write_text("\n".join(lines) + "\n" + tail)
    return path


def test_report_bad_inputs(tmp_path, capsys):
    missing = tmp_path / "none.jsonl"
    one_line(capsys, report_main([str(missing)]), 2, str(missing))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    one_line(capsys, report_main([str(bad)]), 2, f"{bad}:2")
    good = _metrics(tmp_path / "m.jsonl", [2.0, 1.0])
    one_line(capsys, report_main([str(good), "-o", "/proc/galva.html"]), 2, "--output /proc/galva.html")
    one_line(capsys, report_main([str(good), "-o", str(tmp_path)]), 2, "is a directory")
    one_line(capsys, report_main([str(good), "--strategy", "plan.json"]), 2, "--strategy", "--summary")
    step = tmp_path / "step.jsonl"
    step.write_text('{"step": "1", "loss": 1.0}\n')
    one_line(capsys, report_main([str(step)]), 2, f"{step}:1", "'step'")


def test_report_reads_a_truncated_last_line_with_a_warning(tmp_path, capsys):
    cut = _metrics(tmp_path / "cut.jsonl", [2.0, 1.5, 1.0], tail='{"step": 4, "loss": 0.')
    code = report_main([str(cut), "-o", str(tmp_path / "r.html")])
    line = one_line(capsys, code, 0, f"{cut}:4", "incomplete last line")
    assert line.startswith("galva-report: warning: ")
    assert (tmp_path / "r.html").is_file()


def test_report_after_a_nan_loss_has_a_divergence_banner_and_no_finite_last_loss(tmp_path, capsys):
    from galva_models.metrics import json_line

    path = tmp_path / "nan.jsonl"
    records = [{"step": i, "loss": loss, "lr": 1e-3} for i, loss in enumerate([2.0, 1.5, float("nan")], start=1)]
    path.write_text("".join(json_line(r) for r in records))

    def bare(constant: str) -> None:
        pytest.fail(f"bare {constant} in {path}")

    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=bare)  # strict JSON
    assert report_main([str(path), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "DIVERGED" in page and "loss is NaN at step 3" in page
    assert " / NaN / " in page  # the last loss is the NaN, not the last finite one


def test_metrics_on_a_full_disk_warn_once_and_training_goes_on(capsys):
    from galva_models.metrics import MetricsLogger

    logger = MetricsLogger(total_steps=3, jsonl_path="/dev/full", progress=False, log_interval=100)
    for step in range(1, 4):  # /dev/full: every write fails with ENOSPC, as on a full disk
        logger.log({"step": step, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1, "tokens_per_s": 1.0})
    logger.close()
    one_line(capsys, 0, 0, "--metrics-jsonl /dev/full", "No space left on device", "training goes on")


def test_nproc_per_node_checks_the_flags_once_before_starting_ranks(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    bad = _strategy(tmp_path / "bad.json", tp=3)
    line = one_line(capsys, train_main([*GPT2, "--nproc-per-node", "2", "--strategy", str(bad)]), 2, "bad.json")
    assert "layers" in line  # refused in the launching process: no rank was started, so no second copy


def test_nproc_per_node_contradicting_world_size_is_refused(capsys):
    one_line(capsys, train_main([*GPT2, "--nproc-per-node", "2", "--world-size", "4"]), 2,
             "--world-size 4 contradicts --nproc-per-node 2")


def test_ranks_other_than_zero_stay_quiet_about_a_shared_mistake(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert train_main([*GPT2, "--tp", "0"]) == 2
    assert capsys.readouterr().err == ""  # rank 0 says it once for the job


# ------------------------------------------------------------------------------------------- issue #22: no silent run
SEARCH_DATA = Path(__file__).parents[2] / "galva-search" / "tests" / "data"


def _searched_plan(tmp_path: Path) -> tuple[Path, Path]:
    """A strategy and the --summary-json galva-search wrote with it (llama-7b-like, 32 layers, 8 devices)."""
    from galva_search.cli import main as search_main

    plan, summary = tmp_path / "plan.json", tmp_path / "summary.json"
    assert search_main(["--hardware-profile", str(SEARCH_DATA / "hw_1x8.json"), "--model-profile",
                        str(SEARCH_DATA / "llama7b_model.json"), "--memory", "36GB", "--global-batch-size", "16",
                        "--quiet", "--output", str(plan), "--summary-json", str(summary)]) == 0  # fmt: skip
    return plan, summary


def test_report_refuses_a_summary_of_another_plan(tmp_path, capsys):
    plan, summary = _searched_plan(tmp_path)
    metrics = _metrics(tmp_path / "m.jsonl", [2.0, 1.0])
    out = tmp_path / "r.html"
    capsys.readouterr()
    assert report_main([str(metrics), "--strategy", str(plan), "--summary", str(summary), "-o", str(out)]) == 0
    capsys.readouterr()
    out.unlink()
    other = tmp_path / "other.json"  # another model: 80 layers
    Strategy.uniform(world_size=8, num_layers=80, global_batch_size=16).save(other)
    argv = [str(metrics), "--strategy", str(other), "--summary", str(summary), "-o", str(out)]
    line = one_line(capsys, report_main(argv), 2, str(summary), str(other), "32 layers", "80")
    assert line.startswith("galva-report: error: ")
    same_model = Strategy.load(plan).model_copy(update={"global_batch_size": 32})  # same layers, another batch
    same_model.save(other)
    one_line(capsys, report_main(argv), 2, str(summary), "global_batch_size is 16, but 32", str(other))
    assert not out.exists()


def test_report_refuses_a_summary_with_a_duplicate_key(tmp_path, capsys):
    plan, summary = _searched_plan(tmp_path)
    data = json.loads(summary.read_text())
    summary.write_text('{"iteration_time_s": 0.001, ' + json.dumps(data)[1:])
    metrics = _metrics(tmp_path / "m.jsonl", [2.0, 1.0])
    capsys.readouterr()
    code = report_main([str(metrics), "--strategy", str(plan), "--summary", str(summary)])
    one_line(capsys, code, 2, str(summary), "key 'iteration_time_s' appears twice")


def test_data_refuses_an_empty_dataset(tmp_path, corpus_and_tokenizer, capsys):
    _, tokenizer_dir, _ = corpus_and_tokenizer
    corpus = tmp_path / "empty.jsonl"
    corpus.write_text('{"text": ""}\n\n{"text": "   "}\n')
    argv = ["preprocess", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--output-prefix",
            str(tmp_path / "ds"), "--quiet"]  # fmt: skip
    line = one_line(capsys, data_main(argv), 1, str(corpus), "--json-key 'text'", "nothing to train on")
    assert line.startswith("galva-data: error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]  # no .bin / .idx, no temporary file


def test_train_refuses_a_global_batch_beyond_the_schema_bound(capsys):
    """galva_schema.MAX_BATCH_SIZE: 10**30 samples used to pass validation and crash the run."""
    line = one_line(capsys, train_main([*GPT2, "--global-batch-size", str(10**30)]), 2, "global_batch_size",
                    "2147483647")  # fmt: skip
    assert line.startswith("galva-train: error: ")


def test_data_and_report_on_a_full_disk_are_one_line_and_leave_nothing(tmp_path, small_disk, capsys):
    """Issue #22: a real 64 KiB tmpfs, filled; refused before the tokenizer is loaded or the report rendered."""
    disk = small_disk("64k", full=True)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a b"}\n')
    prefix = disk / "ds"
    argv = ["preprocess", "--input", str(corpus), "--tokenizer", str(tmp_path), "--output-prefix", str(prefix)]
    one_line(capsys, data_main(argv), 2, f"--output-prefix {prefix}.bin", "No space left on device")
    html = disk / "r.html"
    metrics = _metrics(tmp_path / "m.jsonl", [2.0, 1.0])
    one_line(capsys, report_main([str(metrics), "-o", str(html)]), 2, f"--output {html}", "No space left on device")
    assert [p.name for p in disk.iterdir()] == ["filler"]
