"""The galva-search command: outputs validate, and every bad-input path ends with one clear line and exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from galva_schema import HardwareProfile, ModelProfile, Strategy
from galva_schema.reference import read_galvatron_strategy, write_galvatron_hardware, write_galvatron_model_profile
from galva_search.cli import main
from galva_search.profiles import parse_memory


@pytest.fixture
def base(data_dir):
    return ["--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile",
            str(data_dir / "llama7b_model.json"), "--quiet"]


def run_cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_writes_strategy_summary_reference_format_and_log(base, tmp_path, capsys):
    out_path, summary, ref, log = (tmp_path / n for n in ("s.json", "summary.json", "galvatron.json", "log.txt"))
    code, out, err = run_cli([*base, "--memory", "36GB", "--min-batch-size", "16", "--max-batch-size", "64",
                                     "--sp-space", "tp+sp", "--output", str(out_path), "--summary-json", str(summary),
                                     "--galvatron-output", str(ref), "--log", str(log)], capsys)
    assert code == 0, err
    strategy = Strategy.load(out_path)  # validates
    assert strategy.world_size == 8 and strategy.num_layers == 32
    data = json.loads(summary.read_text())
    assert data["throughput_samples_per_s"] == pytest.approx(strategy.global_batch_size / data["iteration_time_s"])
    assert data["memory_budget_mib"] == pytest.approx(36e9 / 2**20)
    assert len(data["stage_memory_mib"]) == strategy.pp
    assert all(m <= data["usable_memory_mib"] for m in data["stage_memory_mib"])
    assert data["search_time_s"] > 0
    back = read_galvatron_strategy(ref, world_size=8)
    assert back.layers == strategy.layers and back.pp_division == strategy.pp_division
    lines = log.read_text().splitlines()
    assert len(lines) == data["counts"]["tasks"]
    assert sum("status=best" in line for line in lines) == 1
    assert "samples/s" in out and "stage 0, layers 0" in out
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave nothing behind


@pytest.mark.parametrize("extra", [
    ["--global-strategy"],
    ["--pipeline-schedule", "gpipe", "--default-dp-type", "zero2"],
    ["--search-space", "dp+tp", "--disable-ckpt"],
    ["--search-space", "3d"],
    ["--mixed-precision", "fp32", "--max-tp", "4", "--max-pp", "2", "--num-micro-batches", "4"],
    ["--sp-space", "sp", "--disable-vtp", "--disable-tp-consec"],
])
def test_option_combinations_write_valid_strategies(base, tmp_path, capsys, extra):
    out_path = tmp_path / "s.json"
    code, _, err = run_cli([*base, "--memory", "40GiB", "--global-batch-size", "32", "--output", str(out_path),
                            *extra], capsys)
    assert code == 0, err
    strategy = Strategy.load(out_path)
    assert strategy.global_batch_size == 32
    if "--global-strategy" in extra:
        assert len(set(strategy.layers)) == 1
    if "gpipe" in extra:
        assert strategy.pipeline_schedule.value == "gpipe" and strategy.default_dp_type.value == "zero2"
    if "fp32" in extra:
        assert strategy.mixed_precision.value == "fp32" and strategy.num_micro_batches == 4
        assert strategy.pp <= 2 and all(layer.tp <= 4 for layer in strategy.layers)


def test_reads_reference_profile_files(data_dir, tmp_path, capsys):
    hw = HardwareProfile.load(data_dir / "hw_1x8.json")
    model = ModelProfile.load(data_dir / "llama7b_model.json")
    hw_dir = tmp_path / "hardware"
    write_galvatron_hardware(hw, hw_dir)
    computation, memory = write_galvatron_model_profile(
        model, tmp_path / "computation_profiling_bf16_llama.json", tmp_path / "memory_profiling_bf16_llama.json"
    )
    out_path = tmp_path / "s.json"
    code, _, err = run_cli(["--hardware-profile", str(hw_dir), "--nodes", "1", "--gpus-per-node", "8",
                            "--model-profile", str(computation), "--model-profile", str(memory),
                            "--num-layers", "32", "--hidden-size", "4096", "--seq-length", "2048",
                            "--memory", "36GB", "--global-batch-size", "32", "--quiet", "--output", str(out_path)],
                           capsys)
    assert code == 0, err
    assert Strategy.load(out_path).num_layers == 32


# ------------------------------------------------------------------------------------------------ bad input
def expect_error(args, capsys, *fragments, code=2):
    got, out, err = run_cli(args, capsys)
    assert got == code, (out, err)
    line = err.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in line, line
    return line


def test_missing_file(data_dir, tmp_path, capsys):
    missing = str(tmp_path / "nope.json")
    expect_error(["--hardware-profile", missing, "--model-profile", str(data_dir / "llama7b_model.json"),
                  "--memory", "36GB"], capsys, missing, "file not found")
    expect_error(["--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile", missing,
                  "--memory", "36GB"], capsys, missing)


def test_wrong_kind_of_file(data_dir, capsys):
    model = str(data_dir / "llama7b_model.json")
    expect_error(["--hardware-profile", model, "--model-profile", model, "--memory", "36GB"], capsys,
                 model, "kind", "wrong file type")


def test_not_json(tmp_path, data_dir, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    expect_error(["--hardware-profile", str(bad), "--model-profile", str(data_dir / "llama7b_model.json"),
                  "--memory", "36GB"], capsys, str(bad), "not valid JSON")


def test_missing_required_profile_key(data_dir, tmp_path, capsys):
    data = json.loads((data_dir / "llama7b_model.json").read_text())
    del data["layer_types"][0]["parameter_mib"]
    bad = tmp_path / "model.json"
    bad.write_text(json.dumps(data))
    expect_error(["--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile", str(bad),
                  "--memory", "36GB"], capsys, str(bad), "layer_types[0].parameter_mib", "required key is missing")


def test_missing_activation_entry_needed_by_the_space(data_dir, tmp_path, capsys):
    data = json.loads((data_dir / "llama7b_model.json").read_text())
    del data["layer_types"][0]["activation_mib_per_sample"]["8"]
    bad = tmp_path / "model.json"
    bad.write_text(json.dumps(data))
    expect_error(["--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile", str(bad),
                  "--memory", "36GB", "--global-batch-size", "32"], capsys,
                 str(bad), "layer_types[0].activation_mib_per_sample: no entry for tp 8")


def test_missing_vocab_entry(data_dir, tmp_path, capsys):
    data = json.loads((data_dir / "llama7b_model.json").read_text())
    del data["vocab"]["memory_pp_last"]["model_states_mib"]["1"]
    bad = tmp_path / "model.json"
    bad.write_text(json.dumps(data))
    expect_error(["--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile", str(bad),
                  "--memory", "36GB", "--global-batch-size", "32"], capsys,
                 str(bad), "vocab.memory_pp_last.model_states_mib: no entry for vocab tp 1")


def test_missing_hardware_entry(data_dir, tmp_path, capsys):
    data = json.loads((data_dir / "hw_1x8.json").read_text())
    data["allreduce"] = [e for e in data["allreduce"] if not (e["group_size"] == 4 and not e["consecutive"])]
    bad = tmp_path / "hw.json"
    bad.write_text(json.dumps(data))
    expect_error(["--hardware-profile", str(bad), "--model-profile", str(data_dir / "llama7b_model.json"),
                  "--memory", "36GB", "--global-batch-size", "32"], capsys,
                 str(bad), "allreduce: no entry for group_size 4 (strided)")


def test_missing_key_in_reference_hardware_dir(data_dir, tmp_path, capsys):
    hw_dir = tmp_path / "hardware"
    write_galvatron_hardware(HardwareProfile.load(data_dir / "hw_1x8.json"), hw_dir)
    allreduce = next(hw_dir.glob("allreduce_bandwidth_*"))
    data = json.loads(allreduce.read_text())
    del data["allreduce_size_4_consec_0"]
    allreduce.write_text(json.dumps(data))
    expect_error(["--hardware-profile", str(hw_dir), "--nodes", "1", "--gpus-per-node", "8",
                  "--model-profile", str(data_dir / "llama7b_model.json"), "--memory", "36GB"], capsys,
                 allreduce.name, "allreduce_size_4_consec_0")


def test_reference_hardware_dir_needs_the_cluster_shape(data_dir, tmp_path, capsys):
    hw_dir = tmp_path / "hardware"
    write_galvatron_hardware(HardwareProfile.load(data_dir / "hw_1x8.json"), hw_dir)
    expect_error(["--hardware-profile", str(hw_dir), "--model-profile", str(data_dir / "llama7b_model.json"),
                  "--memory", "36GB"], capsys, str(hw_dir), "--nodes and --gpus-per-node")


def test_reference_model_files_need_layer_counts(data_dir, tmp_path, capsys):
    computation, memory = write_galvatron_model_profile(
        ModelProfile.load(data_dir / "llama7b_model.json"), tmp_path / "c.json", tmp_path / "m.json"
    )
    expect_error(["--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile", str(computation),
                  "--model-profile", str(memory), "--memory", "36GB"], capsys, "--num-layers and --hidden-size")


def test_three_model_files_are_rejected(data_dir, capsys):
    model = str(data_dir / "llama7b_model.json")
    expect_error(["--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile", model,
                  "--model-profile", model, "--model-profile", model, "--memory", "36GB"], capsys,
                 "one Galva file or two reference files")


def test_cluster_shape_must_match_the_profile(base, capsys):
    expect_error([*base, "--nodes", "2", "--memory", "36GB"], capsys, "1 x 8", "not 2 x 8")


def test_megatron_sp_must_match_the_profile(base, capsys):
    expect_error([*base, "--megatron-sp", "--memory", "36GB"], capsys, "megatron_sp", "profiled without")


@pytest.mark.parametrize("memory", ["36", "36XB", "-4GB", "lots"])
def test_bad_memory(base, capsys, memory):
    expect_error([*base, f"--memory={memory}"], capsys, "memory")


def test_bad_batch_options(base, capsys):
    expect_error([*base, "--memory", "36GB", "--min-batch-size", "64", "--max-batch-size", "32"], capsys,
                 "no batch size")
    expect_error([*base, "--memory", "36GB", "--global-batch-size", "0"], capsys, "--global-batch-size")
    expect_error([*base, "--memory", "36GB", "--num-micro-batches", "0"], capsys, "--num-micro-batches")


def test_bad_space_option(base, capsys):
    expect_error([*base, "--memory", "36GB", "--max-tp", "3"], capsys, "max_tp", "power of two")
    expect_error([*base, "--memory", "36GB", "--disable-dp", "--disable-sdp"], capsys, "disable_dp")


def test_unknown_option_is_a_usage_error(base, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*base, "--memory", "36GB", "--bogus"])
    assert exc.value.code == 2


def test_budget_too_small_says_no_feasible_strategy(base, tmp_path, capsys):
    out_path = tmp_path / "s.json"
    line = expect_error([*base, "--memory", "4GiB", "--global-batch-size", "64", "--output", str(out_path)], capsys,
                        "no feasible strategy", "4096 MiB per device", code=1)
    assert "global batch size 64" in line
    assert not out_path.exists()


def test_memory_units():
    assert parse_memory("36GB") == pytest.approx(36e9 / 2**20)
    assert parse_memory("36GiB") == 36 * 1024
    assert parse_memory("36000MiB") == 36000
    assert parse_memory("1 TiB") == 1024 * 1024
    # reserves and overheads may be zero, with or without a unit; budgets may not
    assert parse_memory("0", allow_zero=True) == parse_memory("0MiB", allow_zero=True) == 0.0
    with pytest.raises(ValueError, match="must be positive"):
        parse_memory("0GB")
    with pytest.raises(ValueError, match="must be zero or positive"):
        parse_memory("-1GB", allow_zero=True)


def test_console_script(data_dir, tmp_path):
    exe = shutil.which("galva-search") or str(
        __import__("pathlib").Path(sys.executable).with_name("galva-search")
    )
    out_path = tmp_path / "s.json"
    done = subprocess.run([exe, "--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile",
                           str(data_dir / "llama7b_model.json"), "--memory", "36GB", "--global-batch-size", "16",
                           "--output", str(out_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "search:" in done.stderr  # progress
    assert "predicted" in done.stdout  # the summary, flushed before the process ends without finalization
    Strategy.load(out_path)
    missing = subprocess.run([exe, "--hardware-profile", str(tmp_path / "none.json"), "--model-profile",
                              str(tmp_path / "none.json")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "none.json" in missing.stderr


def test_parser_loads_neither_numpy_nor_pydantic():
    """--help and a bad flag answer before the search's modules load (and main() settles the process before they do)."""
    code = ("import sys; from galva_search.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('numpy', 'pydantic', 'galva_search.search') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_command_process_loads_no_plugin_lookup_and_no_sockets(data_dir, tmp_path):
    """The command's own process (main() settles it) searches and writes its plan without importlib.metadata (pydantic's
    plugin lookup, disabled), socket or subprocess: their imports were ~5% of the command; the plan is the same."""
    args = ["--hardware-profile", str(data_dir / "hw_1x8.json"), "--model-profile",
            str(data_dir / "llama7b_model.json"), "--memory", "36GB", "--global-batch-size", "16", "--quiet"]
    code = ("import sys; from galva_search import cli; cli._settle_process(); "
            f"status = cli._main({[*args, '--output', str(tmp_path / 'a.json')]!r}); "
            "print(status, sorted(m for m in ('importlib.metadata', 'socket', 'subprocess') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0 []"
    assert main([*args, "--output", str(tmp_path / "b.json")]) == 0  # in this process: plugins looked up as usual
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()


def test_micro_batch_count_that_fits_no_strategy(base, capsys):
    expect_error([*base, "--memory", "36GB", "--global-batch-size", "8", "--num-micro-batches", "3"], capsys,
                 "no feasible strategy", "no valid combination", code=1)
