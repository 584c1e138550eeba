"""Ctrl-C and SIGTERM of every long command (issue #22): each is started for real on an input that takes many seconds,
signalled once it is at work, and must end within seconds with exactly one line ``PROG: interrupted (SIGNAL)``, the
status 128 + signal (130, 143), no traceback, no process left behind and no temporary or half-written file in its
output directory. A terminal's Ctrl-C goes to the whole process group (workers and ranks included); a job scheduler's
SIGTERM to the command's own process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
SEARCH_DATA = Path(__file__).resolve().parents[1] / "packages" / "galva-search" / "tests" / "data"
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Ended:
    code: int
    before: list[str]  # stderr lines printed before the signal
    after: list[str]  # stderr lines printed after it
    stdout: list[str] = field(default_factory=list)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _interrupt(
    cmd: Sequence[str],
    ready: Callable[[subprocess.Popen[str], list[str], list[str]], bool],
    *,
    signum: int = signal.SIGINT,
    whole_group: bool = False,
    cwd: Path | None = None,
    start_limit_s: float = 600.0,
) -> Ended:
    """Start ``cmd`` in a session of its own, signal it once ``ready(proc, stdout, stderr)``, wait for it to end."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
        start_new_session=True,
    )  # fmt: skip
    out: list[str] = []
    err: list[str] = []
    readers = [
        threading.Thread(target=lambda: out.extend(line.rstrip("\n") for line in proc.stdout), daemon=True),  # type: ignore[union-attr]
        threading.Thread(target=lambda: err.extend(line.rstrip("\n") for line in proc.stderr), daemon=True),  # type: ignore[union-attr]
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + start_limit_s
        while not ready(proc, out, err):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the command ended or stalled before it was interrupted: {proc.poll()}; {err[-20:]}")
            time.sleep(0.05)
        before = len(err)
        if whole_group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        proc.wait(timeout=120)
        for reader in readers:
            reader.join(timeout=10)
        left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert not left, f"processes left behind: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Ended(proc.returncode, err[:before], err[before:], out)


def _check(ended: Ended, prog: str, signum: int, *, noise: tuple[str, ...] = ()) -> str:
    """One line, the right status, no traceback; ``noise``: prefixes of progress lines that may still arrive."""
    name = signal.Signals(signum).name
    after = [line for line in ended.after if not (noise and line.startswith(noise))]
    everything = ended.before + ended.after
    said = "everything it said:\n" + "\n".join(everything[-60:])  # whole lines: pytest cuts a list's repr
    assert ended.code == 128 + signum, said
    assert len(after) == 1 and after[0].startswith(f"{prog}: interrupted ({name})"), said
    assert sum("interrupted" in line for line in everything) == 1, said
    assert not any(word in line for line in everything for word in ("Traceback", "KeyboardInterrupt")), said
    return after[0]


def _temporaries(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if ".tmp" in p.name)


def test_galva_search(tmp_path):
    out = tmp_path / "out"
    cmd = [
        str(BIN / "galva-search"), "--hardware-profile", str(SEARCH_DATA / "hw_8x8.json"), "--model-profile",
        str(SEARCH_DATA / "llama70b_model.json"), "--memory", "80GB", "--pipeline-schedule", "all",
        "--min-batch-size", "8", "--max-batch-size", "1024", "--threads", "1", "--quiet",
        "--output", str(out / "plan.json"), "--summary-json", str(out / "summary.json"), "--log", str(out / "log.txt"),
    ]  # fmt: skip
    # 3 s of CPU: past the imports, in the search (about 20 s of CPU for the whole run)
    ended = _interrupt(cmd, lambda proc, o, e: _cpu_seconds(proc.pid) > 3.0)
    _check(ended, "galva-search", signal.SIGINT)
    assert ended.before == [] and ended.after == ["galva-search: interrupted (SIGINT)"]
    assert not out.exists() or list(out.iterdir()) == []


def _hf_llama(directory: Path) -> None:
    """A Llama checkpoint of about 70 MB (bf16 zeros): galva-ckpt takes seconds over it."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
        vocab_size=8000, tie_word_embeddings=False, torch_dtype="bfloat16",
    )  # fmt: skip
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    directory.mkdir(parents=True)
    save_file({k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    config.save_pretrained(directory)


def _writing_into(parent: Path, prefix: str) -> Callable[..., bool]:
    """Ready once a temporary output directory ``<prefix>.tmp-*`` under ``parent`` holds a file."""

    def ready(*_: object) -> bool:
        return any(any(d.iterdir()) for d in parent.glob(f"{prefix}.tmp-*") if d.is_dir())

    return ready


@pytest.mark.slow
def test_galva_ckpt_h2g_and_g2h(tmp_path):
    hf, galva, export = tmp_path / "hf", tmp_path / "out" / "galva", tmp_path / "out" / "export"
    _hf_llama(hf)
    h2g = [str(BIN / "galva-ckpt"), "h2g", str(hf), str(galva), "--no-progress"]
    ended = _interrupt(h2g, _writing_into(galva.parent, "galva"))
    _check(ended, "galva-ckpt", signal.SIGINT)
    assert ended.after == ["galva-ckpt: interrupted (SIGINT)"]
    assert list((tmp_path / "out").iterdir()) == []  # no galva/, no galva.tmp-*

    from galva_ckpt.convert import hf_to_galva  # what galva-ckpt h2g runs, here: g2h's input, not a command under test

    hf_to_galva(hf, galva, progress=False)
    g2h = [str(BIN / "galva-ckpt"), "g2h", str(galva), str(export), "--no-progress"]
    ended = _interrupt(g2h, _writing_into(export.parent, "export"), signum=signal.SIGTERM)
    _check(ended, "galva-ckpt", signal.SIGTERM)
    assert ended.after == ["galva-ckpt: interrupted (SIGTERM)"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["galva"]


@pytest.mark.slow
def test_galva_data_preprocess_with_workers(tmp_path):
    from galva.data import train_tokenizer, write_corpus

    corpus = write_corpus(tmp_path / "corpus.jsonl", 10000, 0)
    train_tokenizer(corpus, tmp_path / "tokenizer", 512)
    out = tmp_path / "out"
    cmd = [
        str(BIN / "galva-data"), "preprocess", "--input", str(corpus), "--tokenizer", str(tmp_path / "tokenizer"),
        "--output-prefix", str(out / "corpus"), "--workers", "2", "--quiet",
    ]  # fmt: skip

    def tokenising(*_: object) -> bool:  # the temporary .bin has tokens in it
        return any(p.stat().st_size > 0 for p in out.glob(".corpus.bin.*.tmp")) if out.exists() else False

    ended = _interrupt(cmd, tokenising, whole_group=True)  # Ctrl-C reaches the pool's workers too
    _check(ended, "galva-data", signal.SIGINT)
    assert ended.after == ["galva-data: interrupted (SIGINT)"]
    assert list(out.iterdir()) == []  # neither a half .bin nor a temporary


def test_galva_profile_model(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        str(BIN / "galva-profile"), "model", "--preset", "tiny-llama", "--seq-lengths", "64,128", "--max-tp", "2",
        "-o", str(out / "{model}_seq{seq}.json"), "--report", str(out / "report.json"),
    ]  # fmt: skip
    progress = "model tiny-llama ["
    ended = _interrupt(cmd, lambda proc, o, e: any(line.startswith(progress) for line in e))
    _check(ended, "galva-profile", signal.SIGINT, noise=(progress,))
    assert list(out.iterdir()) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_galva_profile_hardware_on_two_ranks(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [str(BIN / "galva-profile"), "hardware", "--nproc-per-node", "2", "--quick", "-o", str(out / "hw.json")]
    progress = "hardware (2 ranks"
    # Ctrl-C reaches the launcher and both ranks: the job says it once
    ended = _interrupt(cmd, lambda proc, o, e: any(line.startswith(progress) for line in e), whole_group=True)
    _check(ended, "galva-profile", signal.SIGINT, noise=(progress,))
    assert list(out.iterdir()) == []


def _ranks_started(proc: subprocess.Popen[str], *_: object) -> bool:
    """Both ranks of the launcher are running (its only child processes)."""
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    return len(found.stdout.split()) >= 2


@pytest.mark.distributed
def test_ctrl_c_while_the_ranks_start(tmp_path):
    """Ctrl-C the moment the launcher has started its ranks, while they start Python and import torch: they hold the
    signal back until a handler is in place (galva_comm.launch, which galva-train's ranks start through too), so no
    rank prints a KeyboardInterrupt traceback."""
    cmd = [str(BIN / "galva-profile"), "hardware", "--nproc-per-node", "2", "--quick", "--quiet", "-o", "hw.json"]
    ended = _interrupt(cmd, _ranks_started, whole_group=True, cwd=tmp_path)
    _check(ended, "galva-profile", signal.SIGINT)
    assert ended.before == [] and ended.after == ["galva-profile: interrupted (SIGINT)"]
    assert list(tmp_path.iterdir()) == []


def _metrics_lines(path: Path) -> Callable[..., bool]:
    return lambda *_: path.exists() and len(path.read_text().splitlines()) >= 1


@pytest.mark.slow
def test_galva_train_one_process_sigterm(tmp_path):
    metrics = tmp_path / "out" / "metrics.jsonl"
    cmd = [
        str(BIN / "galva-train"), "--model", "tiny-llama", "--train-iters", "100000", "--no-progress",
        "--metrics-jsonl", str(metrics), "--report-html", str(tmp_path / "out" / "report.html"),
    ]  # fmt: skip
    ended = _interrupt(cmd, _metrics_lines(metrics), signum=signal.SIGTERM)
    line = _check(ended, "galva-train", signal.SIGTERM, noise=("step ",))
    assert line.startswith("galva-train: interrupted (SIGTERM) after step ")  # the last completed step
    assert [json.loads(text)["step"] for text in metrics.read_text().splitlines()][:1] == [1]  # whole lines only
    assert _temporaries(tmp_path / "out") == []


@pytest.mark.slow
@pytest.mark.distributed
def test_galva_train_two_ranks_ctrl_c(tmp_path):
    metrics = tmp_path / "out" / "metrics.jsonl"
    cmd = [
        str(BIN / "galva-train"), "--nproc-per-node", "2", "--model", "tiny-llama", "--train-iters", "100000",
        "--no-progress", "--metrics-jsonl", str(metrics),
    ]  # fmt: skip
    ended = _interrupt(cmd, _metrics_lines(metrics), whole_group=True)
    line = _check(ended, "galva-train", signal.SIGINT, noise=("step ",))
    assert line.startswith("galva-train: interrupted (SIGINT) after step ")  # not "cannot start 2 ranks ..."
    assert _temporaries(tmp_path / "out") == []


@pytest.mark.slow
def test_galva_run(tmp_path):
    out = tmp_path / "run"
    cmd = [str(BIN / "galva"), "run", "--quick", "--nproc", "2", "--out", str(out)]
    # the fourth stage line printed: the hardware profile (two ranks under galva-comm's launcher) is running
    ended = _interrupt(cmd, lambda proc, o, e: any(line.startswith("[ 4/") for line in o))
    _check(ended, "galva", signal.SIGINT)
    assert ended.before + ended.after == ["galva: interrupted (SIGINT)"]
    assert _temporaries(out) == []
    assert not (out / "run.json").exists()
