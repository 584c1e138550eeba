"""galva-train's watchdog on real processes: a rank stopped mid-run (SIGSTOP, as a hung device or a stalled node)
ends the job within the collective timeout plus a small margin, with one line naming the rank; nothing is left
behind. Ctrl-C (SIGINT to every rank, as a terminal sends it) ends every rank with one line, no traceback.

The job is four ``python -m galva_models.cli.train`` processes launched as torchrun launches them (RANK, WORLD_SIZE,
MASTER_ADDR/PORT, the rendezvous store hosted by the launcher, here the test), training tiny-gpt2 with tp 2 x dp 2.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

TIMEOUT_S = 10.0
MARGIN_S = 8.0  # the watchdog polls every second; gloo's own timeout is the same number; exiting takes a moment


def _launch(world: int, tmp_path: Path, timeout_s: float) -> tuple[list[subprocess.Popen[bytes]], list[Path], object]:
    store = dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=60), wait_for_workers=False)
    argv = [
        sys.executable, "-m", "galva_models.cli.train", "--model", "tiny-gpt2", "--tp", "2", "--seq-length", "32",
        "--global-batch-size", "4", "--train-iters", "100000", "--no-progress", "--log-interval", "100000",
        "--collective-timeout", str(timeout_s), "--metrics-jsonl", str(tmp_path / "metrics.jsonl"),
    ]  # fmt: skip
    procs, logs = [], []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",  # the launcher (this test) hosts the store, as torchrun's agent does
            OMP_NUM_THREADS="1",
        )
        log = tmp_path / f"rank{rank}.err"
        logs.append(log)
        with log.open("wb") as err:
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err))
    return procs, logs, store


def _wait_for_steps(path: Path, steps: int, procs: list[subprocess.Popen[bytes]], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    pytest.fail(f"the job did not reach step {steps}: exit codes {[p.poll() for p in procs]}")


def _wait_all(procs: list[subprocess.Popen[bytes]], limit_s: float) -> float:
    start = time.monotonic()
    deadline = start + limit_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    return time.monotonic() - start


def _cleanup(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _stderr(logs: list[Path]) -> list[str]:
    return [line for log in logs for line in log.read_text().splitlines()]


@pytest.mark.distributed
@pytest.mark.slow
def test_stopped_rank_ends_the_job_naming_it(tmp_path):
    procs, logs, _store = _launch(4, tmp_path, TIMEOUT_S)
    try:
        _wait_for_steps(tmp_path / "metrics.jsonl", 3, procs, limit_s=240)
        done = len((tmp_path / "metrics.jsonl").read_text().splitlines())  # steps every rank has begun at least
        os.kill(procs[2].pid, signal.SIGSTOP)
        elapsed = _wait_all(procs, TIMEOUT_S + MARGIN_S + 30)
        alive = [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        _cleanup(procs)
    lines = _stderr(logs)
    assert not alive, f"ranks {alive} were left behind; stderr: {lines}"
    assert elapsed <= TIMEOUT_S + MARGIN_S, f"the job took {elapsed:.1f} s to end (timeout {TIMEOUT_S} s)"
    codes = [p.returncode for p in procs]
    assert all(code != 0 for code in codes), codes
    errors = [line for line in lines if "error" in line]
    assert len(errors) == 1, lines
    assert errors[0].startswith("galva-train: error: rank 2 "), errors[0]
    # the others name the collective they wait in; on a loaded machine the stopped rank's silent heartbeat may be
    # the first sign, and then the line names its last step and collective instead
    assert "step " in errors[0] and "--collective-timeout" in errors[0], errors[0]
    assert "waited in " in errors[0] or "stopped responding" in errors[0], errors[0]
    # steps are named by the last one completed, as published when each began: not a heartbeat a second old
    named = [int(k) for k in re.findall(r"after step (\d+)", errors[0])]
    assert named and min(named) >= done - 1, (done, errors[0])
    assert not any("Traceback" in line for line in lines), lines
    print(f"job ended {elapsed:.1f} s after SIGSTOP (timeout {TIMEOUT_S:g} s): {errors[0]}")


@pytest.mark.distributed
@pytest.mark.slow
def test_ctrl_c_ends_every_rank_with_one_line(tmp_path):
    procs, logs, _store = _launch(4, tmp_path, 60.0)
    try:
        _wait_for_steps(tmp_path / "metrics.jsonl", 2, procs, limit_s=240)
        for p in procs:  # what the terminal does: SIGINT to the whole foreground process group
            os.kill(p.pid, signal.SIGINT)
        elapsed = _wait_all(procs, 30)
        alive = [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        _cleanup(procs)
    lines = _stderr(logs)
    assert not alive and elapsed < 10, (alive, elapsed, lines)
    assert [p.returncode for p in procs] == [130] * 4
    interrupted = [line for line in lines if "interrupted" in line]
    assert len(interrupted) == 1 and interrupted[0].startswith("galva-train: interrupted (SIGINT) after step "), lines
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in lines), lines


FAULT = textwrap.dedent(
    """
    import os

    if os.environ.get("RANK") == os.environ.get("GALVA_TEST_FAULT_RANK"):  # one rank raises in its third step
        import galva_hp

        original, calls = galva_hp.train_step, [0]

        def train_step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:
                raise ValueError("injected fault")
            return original(*args, **kwargs)

        galva_hp.train_step = train_step
    """
)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_that_raises_is_named_with_its_own_exception(tmp_path):
    """Rank 1 raises in step 3 of a job started by --nproc-per-node: its traceback and one line naming it, its last
    completed step and its exception; not the other rank's failed collective, nor its SIGTERM from the launcher."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FAULT)  # imported by every rank's interpreter at start-up
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(inject), GALVA_TEST_FAULT_RANK="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "galva_models.cli.train", "--nproc-per-node", "2", "--model", "tiny-llama",
         "--train-iters", "50", "--no-progress", "--log-interval", "100000"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = done.stderr.splitlines()
    assert done.returncode == 1, lines[-20:]
    said = [line for line in lines if line.startswith("galva-train: ") and "tiny-llama on 2 ranks" not in line]
    assert said == ["galva-train: error: rank 1 after step 2: ValueError: injected fault"], lines[-20:]
    assert sum("Traceback" in line for line in lines) == 1  # the failing rank's own, above its line
