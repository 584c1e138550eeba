"""The command end to end: profiles written, fed straight to galva-search; bad input is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from galva_schema import HardwareProfile, ModelProfile, Strategy

PROFILE = [sys.executable, "-m", "galva_profiler.cli"]
HW_FLAGS = ["--sizes-mib", "0.0625,0.125", "--bandwidth-mib", "0.125", "--p2p-mib", "0.125", "--timing-span", "0"]
HW_FLAGS += ["--warmup", "0", "--repetitions", "2", "--quick", "--quiet"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("galva-profile: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """``galva-profile ARGV`` in this process, as the completed process it would be (a subprocess costs 5-8 s of
    imports on 2 loaded cores; bad input is refused before anything is launched). The working directory is the
    caller's: tests that check nothing is written chdir to ``tmp_path``."""
    from galva_profiler.cli import main

    try:
        code = main(argv)
    except SystemExit as end:  # argparse's usage errors
        code = end.code if isinstance(end.code, int) else 1
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


def test_unknown_preset(tmp_path: Path) -> None:
    """The command's own process (the others in this group run ``main`` in this process)."""
    line = _one_error_line(_run([*PROFILE, "model", "--preset", "tiny-lama", "--seq-lengths", "16"], tmp_path))
    assert "unknown model preset 'tiny-lama'" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine without a CUDA device")
def test_a_cuda_model_profile_without_a_gpu_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["model", "--preset", "tiny-llama", "--seq-lengths", "16", "--device", "cuda"]
    line = _one_error_line(_main(argv, capsys))
    assert "--device cuda: torch sees no CUDA device here" in line
    assert list(tmp_path.iterdir()) == []


def test_hardware_sweep_without_a_launcher(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(_main(["hardware", *HW_FLAGS], capsys))
    assert "give --nproc-per-node N" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["model", "hardware"])
def test_unwritable_output_fails_before_measuring(tmp_path: Path, command: str, capsys, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    output = str(blocker / "profile.json")  # a file's child: never writable, even for root
    if command == "model":
        args = ["model", "--preset", "tiny-llama", "--seq-lengths", "16", "-o", output]
    else:
        args = ["hardware", "--nproc-per-node", "2", *HW_FLAGS, "-o", output]
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(_main(args, capsys))
    assert "--output" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_several_lengths_need_a_seq_placeholder(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["model", "--preset", "tiny-gpt2", "--seq-lengths", "16,32", "-o", "x.json"]
    assert "{seq}" in _one_error_line(_main(args, capsys))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.distributed
@pytest.mark.slow
def test_profiles_feed_galva_search(tmp_path: Path, hardware_profile) -> None:
    """The hardware profile is the session's (conftest.py: 2 ranks, with --galvatron-dir)."""
    measured, stdout = hardware_profile(2)
    assert "hardware profile: 2 ranks" in stdout
    assert any((measured / "ref2").iterdir())  # the reference system's files
    (tmp_path / "hw.json").symlink_to(measured / "hw2.json")
    model_args = ["--preset", "tiny-gpt2", "--seq-lengths", "16", "--batch-sizes", "1,2", "--max-tp", "2"]
    model = _run([*PROFILE, "model", *model_args, "--repetitions", "1", "--timing-span", "0", "-o", "m.json",
                  "--report", "r.json"], tmp_path)  # fmt: skip
    assert model.returncode == 0, model.stderr[-2000:]
    assert "[" in model.stderr  # the progress bar
    assert HardwareProfile.load(tmp_path / "hw.json").cluster.world_size == 2
    assert ModelProfile.load(tmp_path / "m.json").constraints is not None
    from galva_search.cli import main as search

    argv = ["--hardware-profile", str(tmp_path / "hw.json"), "--model-profile", str(tmp_path / "m.json")]
    argv += ["--memory", "4GiB", "--global-batch-size", "4", "--output", str(tmp_path / "plan.json"), "--quiet"]
    assert search(argv) == 0
    assert Strategy.load(tmp_path / "plan.json").world_size == 2


# ------------------------------------------------------------------------------------------- issue #22: no silent run
SEARCH_DATA = Path(__file__).parents[2] / "galva-search" / "tests" / "data"


def _in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``galva-profile`` in this process: exit 2 and one ``galva-profile: error:`` line, returned."""
    from galva_profiler.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("galva-profile: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("max_tp", ["3", "6", "256", "0"])
def test_max_tp_must_be_a_power_of_two(tmp_path: Path, max_tp: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--max-tp 3 measured tp 1 and 2 only, silently (the sweep measures powers of two)."""
    out = tmp_path / "m.json"
    line = _in_process(["model", "--preset", "tiny-llama", "--seq-lengths", "16", "--max-tp", max_tp, "--quiet",
                        "-o", str(out)], capsys)  # fmt: skip
    assert f"--max-tp {max_tp}: expected a power of two from 1 to 128" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--preset", "tiny-llama", "--decoder-seq-length", "8"],
         "--decoder-seq-length: tiny-llama has no decoder stream; use --seq-lengths"),
        (["--preset", "tiny-t5", "--decoder-seq-length", "1"], "--decoder-seq-length must be >= 2, got 1"),
        (["--preset", "tiny-llama", "--timing-span", "-1"], "--timing-span must be >= 0 seconds, got -1"),
    ],
)  # fmt: skip
def test_a_bad_sweep_option_is_one_line(tmp_path: Path, args: list[str], expected: str, capsys) -> None:
    """--decoder-seq-length (galva-train's flag) for a model without a decoder stream, or too short, a negative
    --timing-span: one line, nothing written."""
    out = tmp_path / "m.json"
    line = _in_process(["model", *args, "--seq-lengths", "16", "--quiet", "-o", str(out)], capsys)
    assert expected in line
    assert list(tmp_path.iterdir()) == []


def test_check_refuses_the_profile_of_another_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 32-layer llama-7b-like profile checked against tiny-llama: predictions of one model, measurements of
    another."""
    plan = tmp_path / "plan.json"
    Strategy.uniform(world_size=8, num_layers=4, global_batch_size=8).save(plan)
    profile = SEARCH_DATA / "llama7b_model.json"
    line = _in_process(["check", "--hardware-profile", str(SEARCH_DATA / "hw_1x8.json"), "--model-profile",
                        str(profile), "--preset", "tiny-llama", "--strategy", str(plan), "-o",
                        str(tmp_path / "check.json")], capsys)  # fmt: skip
    assert f"--model-profile {profile}" in line and "32 decoder layers of hidden size 4096" in line
    assert "--model tiny-llama has 4 llama layers of hidden size 64" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_check_refuses_a_profile_of_the_same_shape_but_another_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tiny-gpt2 and tiny-llama both have 4 layers of hidden size 64: the parameters of a layer tell them apart."""
    import argparse

    from galva_profiler.check_cli import _check_same_model
    from galva_profiler.model_source import load_config

    data = json.loads((SEARCH_DATA / "llama7b_model.json").read_text())
    layer = data["layer_types"][0]
    layer.update(num_layers=4, hidden_size=64, parameter_mib=0.14111328125)  # tiny-llama's layer: 36 992 parameters
    data.update(model_name="tiny-llama")
    data["vocab"]["vocab_size"] = 128
    profile = tmp_path / "tiny-llama.json"
    profile.write_text(json.dumps(data))
    args = argparse.Namespace(preset="tiny-llama", model_config=None, model_profile=str(profile))
    _check_same_model(load_config("tiny-llama", None)[0], args, ModelProfile.load(profile))  # the same model: accepted
    plan = tmp_path / "plan.json"
    Strategy.uniform(world_size=8, num_layers=4, global_batch_size=8).save(plan)
    line = _in_process(["check", "--hardware-profile", str(SEARCH_DATA / "hw_1x8.json"), "--model-profile",
                        str(profile), "--preset", "tiny-gpt2", "--strategy", str(plan), "-o",
                        str(tmp_path / "check.json")], capsys)  # fmt: skip
    assert "0.1411 MiB of fp32 parameters each" in line and "--model tiny-gpt2 has 4 gpt2 layers" in line



FULL_DISK = [("model", "--output"), ("model", "--report"), ("hardware", "--output"), ("hardware", "--report"),
             ("check", "--output"), ("check", "--table"), ("check", "--calibration-output")]  # fmt: skip


@pytest.mark.parametrize(("command", "flag"), FULL_DISK)
def test_a_full_disk_fails_before_measuring(tmp_path: Path, command: str, flag: str, small_disk, capsys) -> None:
    """Issue #22: a real 64 KiB tmpfs, filled. An empty probe file still fits there; the check writes 64 KiB, so the
    run ends in one line before the sweep or the runs (in this process: nothing is launched or built) instead of a
    traceback after it."""
    from galva_profiler.cli import main

    disk = small_disk("64k", full=True)
    target = disk / "out.json"
    outputs = ["-o", str(target)] if flag == "--output" else ["-o", str(tmp_path / "p.json"), flag, str(target)]
    if command == "model":
        argv = ["model", "--preset", "tiny-llama", "--seq-lengths", "16", "--quick", *outputs]
    elif command == "hardware":
        argv = ["hardware", "--nproc-per-node", "2", *HW_FLAGS, *outputs]
    else:
        argv = ["check", "--hardware-profile", str(SEARCH_DATA / "hw_1x8.json"), "--model-profile",
                str(SEARCH_DATA / "llama7b_model.json"), "--preset", "tiny-llama", "--search", *outputs]  # fmt: skip
    code = main(argv)
    err = capsys.readouterr().err
    line = _one_error_line(subprocess.CompletedProcess(argv, code, "", err))
    assert f"{flag} {target}" in line and "No space left on device" in line, line
    assert [p.name for p in disk.iterdir()] == ["filler"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk0"]


@pytest.mark.parametrize("failing", ["--table", "--output"])
def test_check_outputs_on_a_disk_that_filled_up_are_one_line_and_none_is_left(tmp_path, small_disk, failing) -> None:
    """Issue #22: the disk fills up while the strategies run (after the up-front check): the write that fails is one
    line naming its flag, and the outputs already written are removed again (the report, written last, is never
    alone). A real 64 KiB tmpfs, filled; the outputs that fit go to ``tmp_path``."""
    import argparse

    from galva_profiler.check_cli import write_outputs
    from galva_profiler.errors import ProfileError

    disk = small_disk("64k", full=True)
    paths = {"--table": tmp_path / "t.md", "--output": tmp_path / "check.json", failing: disk / "out"}
    args = argparse.Namespace(table=str(paths["--table"]), output=str(paths["--output"]), calibration_output=None)
    with pytest.raises(ProfileError) as raised:
        write_outputs(args, {"rows": ["x" * 100_000]}, "| table |\n", None)
    line = str(raised.value)
    assert line.startswith(f"{failing} {disk / 'out'}: cannot write: ") and "No space left on device" in line, line
    assert "\n" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk0"] and [p.name for p in disk.iterdir()] == ["filler"]


# a rank's own fault, injected into every rank's interpreter at start-up: rank 1's third timed curve raises
FAULT = """
import os
if os.environ.get("RANK") == "1":
    import galva_profiler.hardware as hardware

    original, calls = hardware.time_curve, []

    def time_curve(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("injected fault")
        return original(*args, **kwargs)

    hardware.time_curve = time_curve
"""


@pytest.mark.distributed
@pytest.mark.slow  # about 20 s each on a loaded 2-core machine: a launcher, two ranks, part of a sweep
@pytest.mark.parametrize("fault", ["raises", "killed"])
def test_a_failed_hardware_rank_ends_the_job_with_one_line(tmp_path: Path, fault: str) -> None:
    """Issue #22: rank 1 of a two-rank sweep raises (its traceback, then one line naming it and its exception), or is
    killed (one line from the launcher); rank 0's collective that fails with it says nothing, nor does the stop the
    launcher sends it; nothing is written."""
    import os
    import signal
    import threading
    import time

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    if fault == "raises":
        (tmp_path / "inject").mkdir()
        (tmp_path / "inject" / "sitecustomize.py").write_text(FAULT)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "inject"), env.get("PYTHONPATH")]))
    flags = [flag for flag in HW_FLAGS if flag != "--quiet"]  # its progress lines say when the sweep is running
    proc = subprocess.Popen([*PROFILE, "hardware", "--nproc-per-node", "2", *flags, "-o", str(tmp_path / "hw.json")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in proc.stderr), daemon=True)
    reader.start()
    try:
        if fault == "killed":
            deadline = time.monotonic() + 300
            while not any(line.startswith("hardware (2 ranks") for line in lines):
                assert proc.poll() is None and time.monotonic() < deadline, lines
                time.sleep(0.05)
            ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            rank1 = [pid for pid in ranks if "RANK=1\0" in Path(f"/proc/{pid}/environ").read_text()]
            os.kill(int(rank1[0]), signal.SIGKILL)
        proc.wait(timeout=300)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = [line for line in lines if not line.startswith("hardware (2 ranks")]
    if fault == "raises":
        assert proc.returncode == 1, said
        assert said[0] == "Traceback (most recent call last):" and said[-2] == "ValueError: injected fault", said
        assert said[-1] == "galva-profile: error: rank 1: ValueError: injected fault", said
        assert sum("Traceback" in line for line in said) == 1  # rank 1's own; rank 0's failed collective is quiet
    else:
        assert proc.returncode == 128 + signal.SIGKILL, said
        assert said == ["galva-profile: rank 1 was killed by SIGKILL"], "\n".join(said)  # all of it: a rare race
    assert sorted(p.name for p in tmp_path.iterdir()) == (["inject"] if fault == "raises" else [])
