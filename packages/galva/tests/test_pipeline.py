"""galva run end to end (the README's main command, reduced as in CI) and its small stages."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from galva.cli import main
from galva.data import documents, train_tokenizer, write_corpus
from galva.pipeline import _search_note
from galva_schema import RunCheck


def test_corpus_is_a_function_of_the_seed(tmp_path: Path) -> None:
    a, b = write_corpus(tmp_path / "a.jsonl", 50, seed=3), write_corpus(tmp_path / "b.jsonl", 50, seed=3)
    assert a.read_bytes() == b.read_bytes()
    assert list(documents(50, seed=4)) != list(documents(50, seed=3))
    lines = a.read_text().splitlines()
    assert len(lines) == 50 and all(json.loads(line)["text"].endswith(".") for line in lines)


def test_tokenizer_round_trips_through_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    corpus = write_corpus(tmp_path / "c.jsonl", 200)
    size = train_tokenizer(corpus, tmp_path / "tok", vocab_size=400)
    assert 260 <= size <= 400
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    text = "The red fox watches the quiet river ."
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id is not None and tok.pad_token_id is not None


def test_model_config_directory_holds_the_tokenizer(tmp_path: Path) -> None:
    """The model directory galva-train's --model-config reads carries the tokenizer into every save (and g2h)."""
    from transformers import AutoConfig, AutoTokenizer

    train_tokenizer(write_corpus(tmp_path / "c.jsonl", 200), tmp_path / "tok", vocab_size=400)
    assert main(["model-config", "-o", str(tmp_path / "model"), "--tokenizer", str(tmp_path / "tok")]) == 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"), local_files_only=True)
    config = AutoConfig.from_pretrained(str(tmp_path / "model"), local_files_only=True)
    assert tok.eos_token_id == config.eos_token_id and len(tok) <= config.vocab_size
    text = "The red fox watches the quiet river ."
    assert tok.decode(tok(text)["input_ids"]) == text


BAD_INPUT = [  # (argv, what the one line names); {tmp}: a directory holding `file`, `dir/` and `busy/x`
    (["model-config", "-o", "{tmp}/m", "--hidden-size", "100", "--num-attention-heads", "3"],
     "--hidden-size 100 is not a multiple of --num-attention-heads 3"),
    (["tokenizer", "{tmp}/missing.jsonl", "-o", "{tmp}/t"], "corpus {tmp}/missing.jsonl: no such file"),
    (["tokenizer", "{tmp}/dir", "-o", "{tmp}/t"], "corpus {tmp}/dir: is a directory"),
    (["tokenizer", "{tmp}/file", "-o", "{tmp}/file"], "--output {tmp}/file: is not a directory"),
    (["corpus", "-o", "{tmp}/dir"], "--output {tmp}/dir: is a directory"),
    (["corpus", "-o", "/proc/galva.jsonl"], "--output /proc/galva.jsonl: cannot write in /proc"),
    (["model-config", "-o", "{tmp}/file"], "--output {tmp}/file: is not a directory"),
    (["model-config", "-o", "{tmp}/m", "--tokenizer", "{tmp}/file"], "--tokenizer {tmp}/file: is not a directory"),
    (["generate", "{tmp}/dir", "--json", "{tmp}/dir"], "--json {tmp}/dir: is a directory"),
    (["generate", "{tmp}/missing"], "model_dir {tmp}/missing: no such directory"),
    (["run", "--out", "{tmp}/busy"], "--out {tmp}/busy is not empty; pass --force"),
    (["run", "--out", "{tmp}/file"], "--out {tmp}/file: is not a directory"),
    (["run", "--bogus"], "unrecognized arguments: --bogus (see galva --help)"),
    (["generate"], "the following arguments are required: model_dir (see galva generate --help)"),
    (["check", "--metrics", "{tmp}/missing.jsonl", "--strategy", "{tmp}/file", "--summary", "{tmp}/file", "-o",
      "{tmp}/c.json"], "--metrics {tmp}/missing.jsonl: no such file"),
    (["check", "--metrics", "{tmp}/file", "--strategy", "{tmp}/file", "--summary", "{tmp}/file", "-o",
      "{tmp}/dir"], "--output {tmp}/dir: is a directory"),
    (["run", "--out", "{tmp}/new", "--calibration", "{tmp}/file"], "--calibration {tmp}/file: "),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "names"), BAD_INPUT, ids=[" ".join(a[:2]) + f" #{i}" for i, (a, _) in
                                                           enumerate(BAD_INPUT)])
def test_bad_input_is_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                            names: str) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    try:
        code = main([arg.format(tmp=tmp_path) for arg in argv])
    except SystemExit as exit_info:  # argparse
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("galva: error: "), err
    assert names.format(tmp=tmp_path) in err, err
    assert (tmp_path / "busy" / "x").read_text() == "keep me" and (tmp_path / "file").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "dir", "file"]  # nothing written
    assert list((tmp_path / "dir").iterdir()) == []


def test_run_on_a_full_disk_is_one_line_and_keeps_an_earlier_run(small_disk, capsys) -> None:
    """Issue #22: a real 64 KiB tmpfs, filled: ``--out`` is refused before any stage (no empty directory left), and
    ``--force`` does not delete an earlier run it could not replace."""
    disk = small_disk("64k")
    earlier = disk / "earlier"
    earlier.mkdir()
    (earlier / "run.json").write_text("{}\n")
    with open(disk / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):
        while True:  # until the disk is full
            filler.write(b"\0" * 4096)
    for out, force in ((disk / "run", []), (earlier, ["--force"])):
        assert main(["run", "--quick", "--out", str(out), *force]) == 2
        message = capsys.readouterr().err
        assert message.count("\n") == 1 and message.startswith(f"galva: error: --out {out}: "), message
        assert "No space left on device" in message
    assert sorted(p.name for p in disk.iterdir()) == ["earlier", "filler"]
    assert (earlier / "run.json").read_text() == "{}\n"

@pytest.mark.slow
@pytest.mark.distributed
def test_galva_run_quick_end_to_end(tmp_path: Path) -> None:
    """The CI variant of the main command, as a user runs it: every stage, every artefact, and the export loads in
    transformers and generates the asked number of tokens.

    CI runs the README's main command (``tools/quickstart.sh --quick``) before the tests and names its output
    directory and console log in ``GALVA_QUICK_RUN`` / ``GALVA_QUICK_RUN_LOG``: this test then checks that run
    instead of repeating the same minutes of work; anywhere else it runs ``galva run --quick`` itself."""
    given = os.environ.get("GALVA_QUICK_RUN")
    if given:
        out, stdout = Path(given), Path(os.environ["GALVA_QUICK_RUN_LOG"]).read_text()
    else:
        out = tmp_path / "run"
        proc = subprocess.run([sys.executable, "-m", "galva.cli", "run", "--quick", "--out", str(out)],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        stdout = proc.stdout
    stage_lines = [line for line in stdout.splitlines() if re.match(r"\[\s*\d+/12\] ", line)]
    names = ["corpus", "tokenizer", "preprocess", "model-config", "profile-hardware", "profile-model", "search",
             "train", "export", "generate", "check", "report"]
    assert [re.match(r"\[\s*\d+/12\] (\S+)", line).group(1) for line in stage_lines] == names, stdout
    run = json.loads((out / "run.json").read_text())
    assert [s["name"] for s in run["stages"]] == names and run["devices"]["ranks"] >= 1
    for stage in run["stages"][4:6]:  # --quick's profiles time for 1 s a measurement, not 5
        assert " --timing-span 1 " in stage["command"], stage["command"]
    for key, path in run["artefacts"].items():
        assert Path(path).exists(), key
        assert path in stdout, key  # the final listing says where it went
    for log in (out / "logs").iterdir():  # each stage's stderr is its log: plain lines, no redrawn bar frames
        assert "\r" not in log.read_text(), log
    assert "train: 8/8 step" in (out / "logs" / "train.log").read_text()  # its own progress, as plain lines
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 9))  # as the checkpoint: step-00000008 after step 8
    assert metrics[-1]["loss"] < metrics[0]["loss"]  # the model learns the corpus
    assert (out / "checkpoints" / "step-00000008" / "manifest.json").is_file()
    generation = json.loads((out / "generation.json").read_text())
    assert generation["model_class"] == "LlamaForCausalLM" and generation["new_tokens"] == 4
    assert generation["text"].startswith(generation["prompt"])
    search_line = next(line for line in stage_lines if "] search" in line)
    # the plan in its one phrase (Strategy.describe), then the summary's prediction, read through SearchSummary
    assert re.search(r"micro-batch(es)?, global batch \d+, .*; predicted [0-9.]+ samples/s", search_line), search_line
    report = (out / "report.html").read_text()
    for section in ('id="plan"', 'id="memory"', 'id="time"', 'id="training"', 'id="measured"', 'id="chart-loss"'):
        assert section in report, section
    # the check stage: the run's own metrics against the prediction, each with its band, in its line and the report
    check = RunCheck.load(out / "check.json")
    hardware = json.loads((out / "profiles" / "hardware.json").read_text())
    assert hardware["base_memory_mib"] > 0 and hardware["optimizer_ms_per_million_parameters"] > 0
    assert check.base_memory_mib.predicted == hardware["base_memory_mib"]  # the measured base was reserved
    assert metrics[0]["base_memory_mib"] == check.base_memory_mib.measured > 0
    check_line = next(line for line in stage_lines if "] check" in line)
    assert re.search(r"step time .* = [0-9.]+x \((within|outside) ±\d+%\), peak .* MiB", check_line), check_line
    assert (check.calibration is None) == all(a.agrees for a in (check.step_time_s, check.peak_memory_mib))
    assert "noise band" in report and f"±{check.step_time_s.noise:.0%}" in report


def test_the_search_stage_reads_the_summary_through_its_class(tmp_path: Path) -> None:
    """galva run's search note comes from the SearchSummary galva-search wrote, checked against the strategy beside
    it; the summary of another plan is refused in one line naming both files."""
    from galva_schema import Strategy
    from galva_search.cli import main as search_main

    data = Path(__file__).resolve().parents[2] / "galva-search" / "tests" / "data"
    plan, summary = tmp_path / "plan.json", tmp_path / "summary.json"
    assert search_main(["--hardware-profile", str(data / "hw_1x8.json"), "--model-profile",
                        str(data / "llama7b_model.json"), "--memory", "36GB", "--global-batch-size", "32", "--quiet",
                        "--output", str(plan), "--summary-json", str(summary)]) == 0  # fmt: skip
    note = _search_note(plan, summary)
    s = Strategy.load(plan)
    assert note.startswith(f"{s.describe()}; layers ") and "; predicted " in note
    assert sum(int(n) for n in re.findall(r" x(\d+)", note)) == s.num_layers  # every layer in one run
    other = tmp_path / "other.json"
    s.model_copy(update={"global_batch_size": 2 * s.global_batch_size}).save(other)
    with pytest.raises(ValueError, match=rf"{summary}: global_batch_size is 32, but 64 in {other}: the summary of"):
        _search_note(other, summary)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` (a guard against a hang, not a timing)."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_running_stage_shows_its_own_last_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a long stage: redirected, an indented line (not a stage line) with the last line of the stage's log
    (tqdm frames split at their carriage returns); on a terminal, that line redrawn in place and cleared at the end."""
    from galva.pipeline import _StageWatch

    monkeypatch.setattr(_StageWatch, "interval_s", 0.05)
    monkeypatch.setattr(_StageWatch, "redraw_s", 0.05)
    log = tmp_path / "train.log"
    log.write_text("$ galva-train ...\ntrain: 3/40 step, 9 s\rstep     10 | loss 5.1234 | lr 1.0e-03\n")
    plain = io.StringIO()
    with _StageWatch(log, "[ 8/11] train            ", plain):
        _until(lambda: "\n" in plain.getvalue())
    first = plain.getvalue().splitlines()[0]
    assert first.startswith("    train ") and first.endswith(" s: step     10 | loss 5.1234 | lr 1.0e-03"), first
    assert "\r" not in plain.getvalue()
    tty = _Terminal()
    with _StageWatch(log, "[ 8/11] train            ", tty):
        _until(lambda: "loss 5.1234" in tty.getvalue())
    assert tty.getvalue().startswith("\r[ 8/11] train") and tty.getvalue().endswith("\r\033[K")


def test_the_model_profile_times_a_rank_s_share_of_the_global_batch() -> None:
    """galva run's model profile measures the batch a rank runs in a plan of up to 2 stages (powers of two up to
    that share, and the share), not a line through smaller batches extrapolated to it."""
    from galva.pipeline import _profiled_batches

    assert _profiled_batches(16, 4) == "1,2,4,8"  # the quickstart: its pp-2 plan runs 8 samples a rank
    assert _profiled_batches(24, 4) == "1,2,4,8,12"
    assert _profiled_batches(16, 1) == "1,2,4,8,16"  # one rank runs the whole batch
    assert _profiled_batches(2, 4) == "1,2"  # a fit needs two sizes
