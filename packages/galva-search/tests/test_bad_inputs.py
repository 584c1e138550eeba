"""Bad inputs for galva-search (issue #12): exit 2 (never the "nothing fits" 1 for an input or output error) and
exactly one line on stderr naming the file, field or flag; never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from galva_search.cli import main

REFERENCE = Path(__file__).parents[2] / "galva-schema" / "tests" / "data" / "galvatron"


@pytest.fixture
def base(data_dir):
    hardware, model = str(data_dir / "hw_1x8.json"), str(data_dir / "llama7b_model.json")
    return ["--hardware-profile", hardware, "--model-profile", model, "--quiet", "--memory", "36GB",
            "--global-batch-size", "16"]  # fmt: skip


def one_line(capsys, argv, code, *names):
    try:
        got = main(argv)
    except SystemExit as exit_info:  # argparse
        got = int(exit_info.code or 0)
    err = capsys.readouterr().err
    assert got == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--output", "/proc/galva/s.json"], ["--output /proc/galva/s.json", "cannot write in /proc"]),
        (["--output", "{tmp}"], ["--output", "is a directory"]),
        (["--summary-json", "/dev/full"], ["--summary-json /dev/full", "not a regular file"]),
        (["--report-html", "/proc/r.html"], ["--report-html"]),
        (["--log", "{tmp}/l.txt", "--output", "{tmp}/l.txt"], ["--output", "--log"]),
        (["--max-tp", "0"], ["--max-tp must be >= 1, got 0"]),
        (["--max-pp", "-1"], ["--max-pp must be >= 1"]),
        (["--min-batch-size", "0"], ["--min-batch-size must be >= 1"]),
        (["--batch-size-scale", "0"], ["--batch-size-scale must be >= 1"]),
        (["--num-micro-batches", "0"], ["--num-micro-batches must be >= 1"]),
        (["--backward-coefficient", "0"], ["--backward-coefficient must be > 0"]),
        (["--backward-coefficient", "nan"], ["--backward-coefficient must be a finite number"]),
        (["--threads", "-1"], ["--threads must be >= 0"]),
        (["--nodes", "0"], ["--nodes must be >= 1"]),
        (["--max-tp", "two"], ["--max-tp", "'two'"]),
        (["--no-such-flag"], ["--no-such-flag"]),
    ],
)
def test_bad_flags_and_outputs_exit_2(base, tmp_path, flags, names, capsys):
    flags = [f.format(tmp=tmp_path) for f in flags]
    one_line(capsys, [*base, *flags], 2, *names)


def test_reference_profile_with_a_hidden_size_the_file_name_contradicts(data_dir, capsys):
    comp = REFERENCE / "models" / "computation_profiling_bf16_hidden4096_head32_seqlen2048.json"
    mem = REFERENCE / "models" / "memory_profiling_bf16_hidden4096_head32_seqlen2048.json"
    argv = ["--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile", str(comp), "--model-profile",
            str(mem), "--num-layers", "32", "--memory", "36GB", "--quiet"]  # fmt: skip
    one_line(capsys, [*argv, "--hidden-size", "1024"], 2, comp.name, "hidden size 4096", "--hidden-size is 1024")
    one_line(
        capsys, [*argv, "--hidden-size", "4096", "--seq-length", "1024"], 2, "sequence length 2048", "--seq-length"
    )


def test_profile_values_are_not_coerced(data_dir, tmp_path, capsys):
    hardware = json.loads((data_dir / "hw_1x8.json").read_text())
    hardware["cluster"]["num_nodes"] = "1"
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(hardware))
    argv = ["--hardware-profile", str(path), "--model-profile", str(data_dir / "llama7b_model.json"), "--quiet"]
    one_line(capsys, argv, 2, str(path), "cluster.num_nodes", "expected an integer")


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--num-layers", "80"], ["--num-layers 80", "32 layers", "not 80"]),
        (["--hidden-size", "8192"], ["--hidden-size 8192", "hidden size 4096"]),
        (["--seq-length", "4096"], ["--seq-length 4096", "sequence length 2048"]),
        (["--model-name", "llama-70b"], ["--model-name 'llama-70b'", "'llama-7b-like'"]),
    ],
)
def test_reference_flags_that_contradict_a_galva_profile(base, data_dir, flags, names, capsys):
    """The flags for reference files were ignored with a Galva profile: a 32-layer plan made for an 80-layer run."""
    one_line(capsys, [*base, *flags], 2, str(data_dir / "llama7b_model.json"), *names)


def test_reference_flags_that_agree_with_a_galva_profile_are_accepted(base, capsys):
    assert main([*base, "--num-layers", "32", "--hidden-size", "4096", "--seq-length", "2048"]) == 0


@pytest.mark.parametrize("flag", ["--global-batch-size", "--max-batch-size", "--num-micro-batches"])
def test_batch_flags_beyond_the_schema_bound_are_refused_before_the_search(base, flag, capsys):
    """10**18 samples: the search spun for 30 s over its divisors and planned 5e17 micro-batches."""
    one_line(capsys, [*base, flag, str(10**18)], 2, f"{flag} must be <= 2147483647", str(10**18))


@pytest.mark.parametrize("flag", ["--output", "--summary-json", "--galvatron-output", "--log", "--report-html"])
def test_every_output_on_a_full_disk_is_one_line_and_leaves_nothing(base, flag, small_disk, capsys):
    """Issue #22: a full disk (a real 64 KiB tmpfs, filled) is an output error, refused before the search."""
    disk = small_disk("64k", full=True)
    target = disk / "out"
    one_line(capsys, [*base, flag, str(target)], 2, f"{flag} {target}", "No space left on device")
    assert [p.name for p in disk.iterdir()] == ["filler"]  # no temporary or probe file left
