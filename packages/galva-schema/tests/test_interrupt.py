"""galva_schema.interrupt on real processes and real signals: one line, 128 + signal, no traceback, no temporary file.

Each test starts a small program built on :func:`run_command`, waits until it says it started, signals it and reads
what it left: its exit status, its stderr and its output directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PRELUDE = textwrap.dedent(
    """
    import os, signal, sys, time
    from galva_schema import write_bytes_atomic
    from galva_schema.interrupt import run_command

    OUT = sys.argv[1]

    def started():
        print("started", flush=True)

    def write_forever():
        while True:  # every file is written whole or not at all, however often the signal lands mid-write
            write_bytes_atomic(os.path.join(OUT, "out.bin"), os.urandom(1 << 20))
    """
)


def _start(tmp_path: Path, program: str, *, session: bool = False) -> subprocess.Popen[str]:
    script = tmp_path / "program.py"
    script.write_text(PRELUDE + textwrap.dedent(program))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=session,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started", proc.communicate()
    return proc


def _finish(proc: subprocess.Popen[str], limit_s: float = 60) -> tuple[int, list[str]]:
    _, err = proc.communicate(timeout=limit_s)
    return proc.returncode, err.splitlines()


def _wait_for(path: Path, proc: subprocess.Popen[str], limit_s: float) -> None:
    """Wait until ``path`` exists (the program reached a point it announces by writing it), failing after
    ``limit_s`` seconds or when the program ends first."""
    deadline = time.monotonic() + limit_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path.name} not written within {limit_s} s"
        time.sleep(0.05)


def _read_to_end(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """(stdout, stderr) of a program that ends with status 0. Read on through the text streams: the readline() of
    :func:`_start` may already hold the program's later output in its buffer, which communicate() (reading the pipe
    itself) would miss."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 0, err
    return out, err


def _leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "out").iterdir() if p.name != "out.bin")


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_command_with_one_line_and_no_temporary_file(tmp_path, signum, status):
    proc = _start(tmp_path, "sys.exit(run_command('demo', lambda: started() or write_forever(), end_process=True))")
    time.sleep(0.5)  # mid-way through some write
    proc.send_signal(signum)
    code, lines = _finish(proc)
    assert code == status
    assert lines == [f"demo: interrupted ({signal.Signals(signum).name})"]
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_shutdown_after_success_keeps_the_success(tmp_path, signum):
    """The command's work is done and its outputs are whole: a signal landing while Python shuts down (torch's
    finalization takes seconds) neither turns the exit into a silent death by signal nor prints a traceback; the
    status is the command's own (0)."""
    program = f"""
        import atexit

        def late():  # during interpreter finalization, after the command returned
            os.kill(os.getpid(), {int(signum)})
            time.sleep(0.5)
            print("finalized", file=sys.stderr, flush=True)

        atexit.register(late)
        sys.exit(run_command("demo", lambda: started() or 0, end_process=True))
        """
    code, lines = _finish(_start(tmp_path, program))
    assert (code, lines) == (0, ["finalized"])


def test_in_process_the_status_is_returned_and_the_handlers_restored(tmp_path):
    program = """
        before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)

        def body():
            started()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises here
            return 0

        code = run_command("demo", body)
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
        print(code, flush=True)
        """
    out, err = _read_to_end(_start(tmp_path, program))
    assert out.strip() == "143" and err.splitlines() == ["demo: interrupted (SIGTERM)"]


def test_a_signal_while_the_command_takes_its_signals_is_the_one_line(tmp_path):
    """Ctrl-C the moment a command (a rank) installs its handlers: the handler is live from the first signal.signal
    on, and a signal landing before run_command's try raised past it, a traceback (CI, once). The signal here lands
    between the handlers and the wakeup fd; the command still ends with its line and 130, the handlers restored."""
    program = """
        before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        real = signal.set_wakeup_fd
        calls = []

        def set_wakeup_fd(fd, **kwargs):  # install's second step: the handlers are in place
            if not calls:
                calls.append(fd)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)  # the handler raises here
            return real(fd, **kwargs)

        signal.set_wakeup_fd = set_wakeup_fd
        started()
        code = run_command("demo", lambda: 0)
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
        print(code, flush=True)
        """
    out, err = _read_to_end(_start(tmp_path, program))
    assert out.strip() == "130" and err.splitlines() == ["demo: interrupted (SIGINT)"], err


@pytest.mark.parametrize("end_process", [True, False])
def test_a_signal_as_the_command_ends_is_never_a_traceback(tmp_path, end_process):
    """SIGTERM landing after the body returned, while run_command hands the signals back (a rank's launcher ending
    the job as that rank finished: a traceback from the handler's exception, on CI, once). The command's process
    keeps its success; called in-process, the signal goes to the handler handed back, once it is back."""
    program = f"""
        real = signal.set_wakeup_fd
        calls = []

        def set_wakeup_fd(fd, **kwargs):
            calls.append(fd)
            if len(calls) == 2:  # uninstall handing the wakeup fd back: the body has returned
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # the handler runs here
            return real(fd, **kwargs)

        signal.set_wakeup_fd = set_wakeup_fd
        signal.signal(signal.SIGTERM, lambda signum, frame: print("handed back", flush=True))
        started()
        code = run_command("demo", lambda: 0, end_process={end_process})
        print(code, flush=True)
        """
    out, err = _read_to_end(_start(tmp_path, program))
    assert err == ""
    assert out.splitlines() == (["0"] if end_process else ["handed back", "0"])


def test_a_main_thread_stuck_in_native_code_is_ended_by_the_helper_thread(tmp_path):
    # the main thread never sees the signal (blocked in it, as in a C++ collective that never returns to Python)
    program = """
        def stuck():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            started()
            time.sleep(600)
            return 0

        sys.exit(run_command("demo", stuck))
        """
    proc = _start(tmp_path, program)
    proc.send_signal(signal.SIGINT)
    code, lines = _finish(proc, limit_s=120)
    assert code == 130 and lines == ["demo: interrupted (SIGINT)"]


def test_forked_workers_leave_the_ending_to_the_parent(tmp_path):
    # Ctrl-C at a terminal: SIGINT to the parent and every pool worker at once
    program = """
        import multiprocessing as mp
        from galva_schema.interrupt import forked_worker, forking

        def spin(i):
            end = time.monotonic() + 600
            while time.monotonic() < end:
                pass

        def body():
            with forking():
                pool = mp.get_context("fork").Pool(2, initializer=forked_worker)
            with pool:
                result = pool.map_async(spin, range(2))
                started()
                result.get()
            return 0

        sys.exit(run_command("demo", body, end_process=True))
        """
    proc = _start(tmp_path, program, session=True)
    time.sleep(1.0)  # the workers are spinning
    os.killpg(proc.pid, signal.SIGINT)
    code, lines = _finish(proc)
    assert code == 130 and lines == ["demo: interrupted (SIGINT)"]  # no worker's KeyboardInterrupt traceback
    assert subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).stdout == b""  # no worker left


def test_a_signal_inside_forking_is_raised_as_the_block_ends(tmp_path):
    """The kernel gives a process's SIGINT to a thread not blocking it (here the guard's own), and Python runs the
    handler in the main thread at once: inside forking() it is held back to the block's end, so a caller that forks
    there learns of every child it started before it unwinds (a rank was left behind when it raised mid-start)."""
    program = """
        from galva_schema.interrupt import forking

        def body():
            started()
            with forking():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)  # Python would have run the handler here
                print("inside", flush=True)
            print("after", flush=True)
            return 0

        sys.exit(run_command("demo", body, end_process=True))
        """
    proc = _start(tmp_path, program)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.splitlines() == ["demo: interrupted (SIGINT)"], err
    assert out.split() == ["inside"]


def test_wait_child_passes_the_signal_on_and_waits_for_the_child(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(PRELUDE + "sys.exit(run_command('child', write_forever, end_process=True))\n")
    program = f"""
        import subprocess
        from galva_schema.interrupt import wait_child

        def body():
            with open(os.path.join(OUT, "child.log"), "w") as log:
                proc = subprocess.Popen([sys.executable, {str(child)!r}, OUT], stderr=log, start_new_session=True)
                started()
                return wait_child(proc)

        sys.exit(run_command("parent", body, end_process=True))
        """
    proc = _start(tmp_path, program)
    # the child's first whole file means run_command has installed its handler: a signal before that would kill it
    # unannounced (a fixed 2 s wait lost that race under load)
    _wait_for(tmp_path / "out" / "out.bin", proc, limit_s=120)
    proc.send_signal(signal.SIGTERM)  # to the parent alone, as a job scheduler sends it
    code, lines = _finish(proc, limit_s=120)
    assert code == 143 and lines == ["parent: interrupted (SIGTERM)"]
    assert (tmp_path / "out" / "child.log").read_text().splitlines() == ["child: interrupted (SIGTERM)"]
    assert _leftovers(tmp_path) == ["child.log"]  # the child, not killed, removed its temporary file


def test_one_process_of_a_job_says_it(tmp_path):
    """Every rank interrupted at once: with a launcher's note file the first writes its line there (the launcher
    prints it); without one, rank 0 says it."""
    from galva_schema.interrupt import NOTE_ENV

    program = "sys.exit(run_command('job', lambda: started() or write_forever(), end_process=True))"
    script = tmp_path / "program.py"
    script.write_text(PRELUDE + textwrap.dedent(program))
    for note in (str(tmp_path / "note"), None):
        procs = []
        for rank in range(3):
            out = tmp_path / f"out-{note is None}-{rank}"
            out.mkdir()
            env = {**os.environ, "RANK": str(rank)}
            env.pop(NOTE_ENV, None)
            if note:
                env[NOTE_ENV] = note
            procs.append(
                subprocess.Popen([sys.executable, str(script), str(out)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            )  # fmt: skip
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "started"
        for p in procs:
            p.send_signal(signal.SIGINT)
        results = [_finish(p) for p in procs]
        assert [code for code, _ in results] == [130] * 3
        said = [line for _, lines in results for line in lines]
        if note:  # the first writes its line for the launcher to print; none prints
            assert said == [] and Path(note).read_text() == "job: interrupted (SIGINT)"
        else:
            assert said == ["job: interrupted (SIGINT)"]
