"""galva_comm.launch: ranks started without torchrun end a failed job with one line, never torch's failure table."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

RANK_PROGRAM = textwrap.dedent(
    """
    import os, signal, sys
    assert os.environ["WORLD_SIZE"] == "2" and os.environ["MASTER_ADDR"]
    if os.environ["RANK"] == "1":
        if sys.argv[1] == "exit":
            print("ranks: error: rank 1 refuses", file=sys.stderr)
            sys.exit(2)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize(
    ("mode", "code", "stderr"),
    [("ok", 0, ""), ("exit", 2, "ranks: error: rank 1 refuses"), ("kill", 137, "ranks: rank 1 was killed by SIGKILL")],
)
def test_a_failed_rank_ends_the_job_with_one_line(tmp_path, mode, code, stderr):
    (tmp_path / "ranks.py").write_text(RANK_PROGRAM)
    launcher = (
        "import sys; from galva_comm.launch import launch_local; "
        f"sys.exit(launch_local(2, 'ranks', ['{mode}'], prog='ranks'))"
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", launcher], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == code, done.stderr
    assert done.stderr.strip() == stderr  # no torchrun traceback or failure table, no warning banner


def test_bad_rank_count_is_refused():
    from galva_comm.launch import LaunchError, launch_local

    with pytest.raises(LaunchError, match="--nproc-per-node must be >= 1, got 0"):
        launch_local(0, "ranks", [], prog="ranks")
