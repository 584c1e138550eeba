"""galva-train loses nothing silently (issue #22): a save directory has one owner, a resumed run appends to its
metrics, a save that cannot be written (a full disk) ends the run in one line with the earlier saves intact.

The runs are the real ``galva-train``: a separate process (killed half-way), ``main(argv)`` in forked gloo ranks,
``main(argv)`` in this process for what is refused before any process group, and ``--nproc-per-node 2`` on a real,
small tmpfs for the full disk.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from galva_ckpt.checkpoint import CheckpointReader
from galva_ckpt.saves import LOCK_FILE
from galva_comm.testing import free_port, run_distributed
from galva_models.cli.train import main as train_main
from galva_models.metrics import MetricsLogger

STALLED_SAVE = str(Path(__file__).with_name("_stalled_save.py"))  # galva-train whose save of a step stops half way
RUN = ["--model", "tiny-llama", "--fp32", "--global-batch-size", "2", "--seq-length", "16", "--no-progress",
       "--log-interval", "1000"]  # fmt: skip


def _galva_train(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    """One rank of ``galva-train argv`` through its ``main``: (exit code, what it wrote on stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train_main(argv)
    return code, err.getvalue()


def galva_train(argv: list[object], world: int = 1) -> list[tuple[int, str]]:
    return run_distributed(_galva_train, world, [str(a) for a in argv], timeout=120)


def records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def one_error_line(err: str, *needles: str) -> str:
    """The one ``galva-train: error:`` line of ``err`` (the start-of-run banner may come before it); no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if not line.startswith("galva-train: tiny-llama on ")]
    assert len(lines) == 1 and lines[0].startswith("galva-train: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_a_second_run_on_a_save_dir_in_use_is_refused_and_a_resume_continues_the_metrics(tmp_path, capsys, monkeypatch):
    """Run 1 holds --save (stopped inside its second save); run 2 on the same directory is refused in one line naming
    run 1's pid and host, touching nothing. Run 1 is killed: its stale lock does not block the resume, which appends
    to run 1's metrics (dropping the step it re-does): the file equals an uninterrupted run's, bit for bit."""
    root, metrics = tmp_path / "saves", tmp_path / "metrics.jsonl"
    first = [*RUN, "--train-iters", "3", "--save", str(root), "--save-interval", "1", "--metrics-jsonl", str(metrics)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # fmt: skip
    proc = subprocess.Popen([sys.executable, STALLED_SAVE, "2", *first], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 600  # a guard against a hang, not a timing: a loaded machine starts slowly
        while not list(root.glob("step-00000002.tmp-*")):  # step 2 is logged: its save has begun, and stalls
            assert proc.poll() is None and time.time() < deadline, "the run ended before its second save"
            time.sleep(0.05)
        before = sorted(p.name for p in root.iterdir())
        logged = metrics.read_text()
        assert [r["step"] for r in records(metrics)] == [1, 2]

        monkeypatch.delenv("RANK", raising=False)
        capsys.readouterr()
        holder = f"in use by another run (pid {proc.pid} on host {socket.gethostname()})"
        for launch in ([], ["--nproc-per-node", "2"]):  # refused in the process itself or before it starts ranks
            code = train_main([*first, *launch])
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
            assert err.startswith(f"galva-train: error: --save {root}: {holder}"), err
        assert sorted(p.name for p in root.iterdir()) == before and metrics.read_text() == logged
        assert CheckpointReader(root / "step-00000001").verify_all()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert str(proc.pid) in (root / LOCK_FILE).read_text()  # left by the killed run, its lock gone with it

    resume = [*RUN, "--train-iters", "3", "--load", root, "--save", root, "--metrics-jsonl", metrics]
    [(code, err)] = galva_train(resume)
    assert code == 0 and "continuing from step 1" in err, err
    assert not (root / LOCK_FILE).exists()  # released at the end of the run
    assert (root / "step-00000003").is_dir()
    [(code, _)] = galva_train([*RUN, "--train-iters", "3", "--metrics-jsonl", tmp_path / "full.jsonl"])
    assert code == 0
    resumed, full = records(metrics), records(tmp_path / "full.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3]  # step 2 once: run 1's record of it was dropped
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]  # the same plan: bit-identical

    # --finetune (weights only) and a fresh run start the file anew
    [(code, _)] = galva_train([*RUN, "--train-iters", "1", "--load", root, "--finetune", "--metrics-jsonl", metrics])
    assert code == 0 and [r["step"] for r in records(metrics)] == [1]
    [(code, _)] = galva_train([*RUN, "--train-iters", "2", "--metrics-jsonl", metrics])
    assert code == 0 and [r["step"] for r in records(metrics)] == [1, 2]


def test_resumed_metrics_drop_redone_steps_and_a_line_cut_by_a_crash(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 5)]
    path.write_text("".join(lines) + '{"step": 5, "lo')  # the last write of a killed run
    logger = MetricsLogger(total_steps=5, jsonl_path=path, progress=False, log_interval=100, resume_step=2)
    logger.log({"step": 3, "loss": 9.0, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1, "tokens_per_s": 1.0})
    logger.close()
    assert [(r["step"], r["loss"]) for r in records(path)] == [(1, 1.0), (2, 2.0), (3, 9.0)]  # after step 2's save


def test_a_full_disk_during_a_save_ends_in_one_line_and_keeps_the_earlier_save(small_disk):
    """A 3 MiB disk holds one save of tiny-llama with its optimizer state (about 2 MiB), not two: the save of step 2
    fails with ENOSPC on the ranks, which end together with one line; step 1's save is intact, no temporary is left.
    Two ranks started by ``--nproc-per-node`` (the launching process owns the directory; its ranks do not lock)."""
    root = small_disk("3m") / "saves"
    argv = [*RUN, "--nproc-per-node", "2", "--train-iters", "3", "--save", str(root), "--save-interval", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-m", "galva_models.cli.train", *argv], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 1, done.stderr
    one_error_line(done.stderr, f"cannot save checkpoint to {root / 'step-00000002'}: No space left on device")
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]  # no .tmp-*, no lock file
    assert CheckpointReader(root / "step-00000001").verify_all()
