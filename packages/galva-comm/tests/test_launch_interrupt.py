"""galva_comm.launch under Ctrl-C and SIGTERM: the whole job ends with one line and 128 + signal, no rank left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

RANK_PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    from galva_schema.interrupt import run_command

    def body():
        print("started", flush=True)  # every rank: a signal before its handler is in place is not what is tested
        while True:
            time.sleep(0.05)

    sys.exit(run_command("ranks", body, end_process=True))
    """
)
LAUNCHER = (
    "import sys; from galva_comm.launch import launch_local; from galva_schema.interrupt import run_command; "
    "sys.exit(run_command('ranks', lambda: launch_local(2, 'ranks', [], prog='ranks'), end_process=True))"
)


@pytest.mark.parametrize(
    ("signum", "whole_group"),
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["ctrl-c-to-the-process-group", "sigterm-to-the-launcher"],
)
def test_an_interrupted_job_ends_with_one_line(tmp_path, signum, whole_group):
    (tmp_path / "ranks.py").write_text(RANK_PROGRAM)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        seen = ""
        while seen.count("started") < 2:  # both ranks (their lines may interleave)
            line = proc.stdout.readline()
            assert line, proc.stderr
            seen += line
        if whole_group:  # what a terminal does
            os.killpg(proc.pid, signum)
        else:  # what a job scheduler does
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum
    assert err.splitlines() == [f"ranks: interrupted ({signal.Signals(signum).name})"]  # no agent warning or table
    assert subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).stdout == b""  # no rank left
