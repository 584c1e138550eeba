"""Bad files for galva-schema (issue #12): values are never coerced (as the exported JSON Schema says), and every
refusal is one line naming the file and the field; never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from galva_schema import Strategy
from galva_schema.cli import main

STRATEGIES = Path(__file__).parent / "data" / "galvatron" / "strategies"
EXAMPLE = STRATEGIES / "galvatron_config_gpt-2.7b_1nodes_8gpus_per_node_40GB_bf16_example.json"


def one_line(capsys, argv, code, *names):
    got = main(argv)
    err = capsys.readouterr().err
    assert got == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("galva-schema: error: "), lines[0]  # every command's prefix (issue #22)
    for name in names:
        assert name in lines[0], lines[0]


def _plan(tmp_path: Path, **changes: object) -> Path:
    data = Strategy.uniform(world_size=4, num_layers=2, global_batch_size=8, layer={"tp": 2}).to_dict()
    for key, value in changes.items():
        if key.startswith("layer_"):
            data["layers"] = [{**layer, key.removeprefix("layer_"): value} for layer in data["layers"]]
        else:
            data[key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"layer_tp": "2"}, "layers[0].tp: expected an integer"),
        ({"layer_checkpoint": "yes"}, "layers[0].checkpoint: expected a boolean"),
        ({"layer_checkpoint": 1}, "layers[0].checkpoint: expected a boolean"),
        ({"global_batch_size": 8.0}, "global_batch_size: expected an integer"),
        ({"pp": True}, "pp: expected an integer"),
        ({"megatron_sp": "false"}, "megatron_sp: expected a boolean"),
        ({"vocab": {"tp": "1"}}, "vocab.tp: expected an integer"),
    ],
)
def test_strategy_values_are_not_coerced(tmp_path, changes, field, capsys):
    path = _plan(tmp_path, **changes)
    one_line(capsys, ["validate", str(path)], 1, str(path), field)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"pp_deg": "2"}, "pp_deg: expected an integer"),
        ({"checkpoint": "yes,no"}, "checkpoint[0]"),
        ({"global_bsz": True}, "global_bsz"),
    ],
)
def test_reference_strategy_scalars_are_not_coerced(tmp_path, changes, field, capsys):
    path = tmp_path / "galvatron_config.json"
    path.write_text(json.dumps({**json.loads(EXAMPLE.read_text()), **changes}))
    argv = ["convert", "--from-galvatron-strategy", str(path), "--world-size", "8", "-o", str(tmp_path / "o.json")]
    one_line(capsys, argv, 1, str(path), field)


def test_convert_names_flags_and_checks_the_output(tmp_path, capsys):
    data = {k: v for k, v in json.loads(EXAMPLE.read_text()).items() if k != "world_size"}
    path = tmp_path / "galvatron_config.json"
    path.write_text(json.dumps(data))
    one_line(capsys, ["convert", "--from-galvatron-strategy", str(path), "-o", str(tmp_path / "o.json")], 1,
             "world_size", "--world-size")  # fmt: skip
    one_line(capsys, ["convert", "--from-galvatron-strategy", str(EXAMPLE), "--world-size", "8", "-o", "/proc/o.json"],
             2, "--output /proc/o.json")  # fmt: skip


# ------------------------------------------------------------------------------------------- issue #22: no silent run
GALVATRON = Path(__file__).parent / "data" / "galvatron"


def _duplicated(data: dict, key: str, value: object) -> str:
    """``data`` as JSON text whose top-level object holds ``key`` twice: ``value`` first, then ``data``'s own."""
    return "{" + json.dumps(key) + ": " + json.dumps(value) + ", " + json.dumps(data)[1:]


def _galva_files() -> dict[str, tuple[dict, str, object]]:
    """A valid file of every kind galva-schema reads, the key to give twice and its first (shadowed) value."""
    from galva_schema import CheckpointManifest, ClusterSpec
    from galva_schema.reference import read_galvatron_hardware, read_galvatron_model_profile

    hardware = read_galvatron_hardware(GALVATRON / "hardware", num_nodes=1, gpus_per_node=8)
    model = read_galvatron_model_profile(
        GALVATRON / "models" / "computation_profiling_bf16_llama-7b.json",
        GALVATRON / "models" / "memory_profiling_bf16_llama-7b.json",
        model_name="llama-7b", num_layers=[32], hidden_sizes=[4096], seq_lengths=[2048],
    )  # fmt: skip
    manifest = CheckpointManifest(model_family="gpt2", model_config_dict={}, num_layers=0, modules=())
    return {
        "strategy": (Strategy.uniform(world_size=4, num_layers=2, global_batch_size=8).to_dict(), "pp", 2),
        "cluster": (ClusterSpec(gpus_per_node=8).to_dict(), "gpus_per_node", 4),
        "hardware_profile": (hardware.to_dict(), "cluster", {"gpus_per_node": 4}),
        "model_profile": (model.to_dict(), "model_name", "llama-70b"),
        "checkpoint_manifest": (manifest.to_dict(), "num_layers", 80),
    }


@pytest.mark.parametrize("kind", ["strategy", "cluster", "hardware_profile", "model_profile", "checkpoint_manifest"])
def test_duplicate_keys_are_refused_in_every_file(tmp_path, kind, capsys):
    """json keeps the last of two equal keys silently; galva-schema's one reader refuses the file, naming the key."""
    data, key, value = _galva_files()[kind]
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(data))
    assert main(["validate", str(path)]) == 0  # the file itself is valid
    capsys.readouterr()
    path.write_text(_duplicated(data, key, value))
    one_line(capsys, ["validate", str(path)], 1, str(path), f"key '{key}' appears twice")


def test_duplicate_key_inside_a_layer_and_through_load(tmp_path, capsys):
    from galva_schema import SchemaError

    text = json.dumps(Strategy.uniform(world_size=4, num_layers=2, global_batch_size=8).to_dict())
    path = tmp_path / "plan.json"
    path.write_text(text.replace('"layers": [{', '"layers": [{"tp": 4, ', 1))
    one_line(capsys, ["validate", str(path)], 1, str(path), "key 'tp' appears twice")
    with pytest.raises(SchemaError, match="key 'tp' appears twice"):  # what galva-train and galva-search read
        Strategy.load(path)


def test_binary_and_deeply_nested_files(tmp_path, capsys):
    binary = tmp_path / "plan.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    one_line(capsys, ["validate", str(binary)], 1, str(binary), "not a JSON text file", "not UTF-8")
    nested = tmp_path / "nested.json"
    nested.write_text('{"kind": "galva.strategy", "description": ' + "[" * 100_000 + "]" * 100_000 + "}")
    one_line(capsys, ["validate", str(nested)], 1, str(nested), "nested too deeply")


def test_batch_sizes_have_a_documented_upper_bound(tmp_path, capsys):
    from galva_schema import MAX_BATCH_SIZE

    assert MAX_BATCH_SIZE == 2**31 - 1
    Strategy.uniform(world_size=1, num_layers=1, global_batch_size=MAX_BATCH_SIZE)  # the bound itself is allowed
    for field, value in (("global_batch_size", 10**30), ("num_micro_batches", 2**31)):
        path = _plan(tmp_path, **{field: value})
        one_line(capsys, ["validate", str(path)], 1, str(path), field, "less than or equal to 2147483647")


@pytest.mark.parametrize(
    ("argv", "code", "names"),
    [
        (["validate"], 2, ["FILE"]),
        (["no-such-command"], 2, ["no-such-command"]),
        (["export-schemas", "/proc/galva-schemas"], 2, ["/proc/galva-schemas", "cannot write"]),
        (["validate", "/nonexistent/plan.json"], 1, ["/nonexistent/plan.json", "file not found"]),
    ],
)
def test_every_error_line_starts_with_the_command(argv, code, names, capsys):
    """docs/troubleshooting.md: `<command>: error: ...`; argparse's usage block is not printed."""
    try:
        got = main(argv)
    except SystemExit as exit_info:
        got = int(exit_info.code or 0)
    err = capsys.readouterr().err
    assert got == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("galva-schema: error: ") and "Traceback" not in err, err
    for name in names:
        assert name in lines[0], lines[0]


def test_convert_and_export_on_a_full_disk_are_one_line_and_leave_nothing(tmp_path, small_disk, capsys):
    """Issue #22: a real 64 KiB tmpfs, filled; nothing is created on it (no temporary file, no empty directory)."""
    disk = small_disk("64k", full=True)
    out = disk / "o.json"
    one_line(capsys, ["convert", "--from-galvatron-strategy", str(EXAMPLE), "--world-size", "8", "-o", str(out)],
             2, f"--output {out}", "No space left on device")  # fmt: skip
    one_line(capsys, ["export-schemas", str(disk / "schemas")], 2, str(disk / "schemas"), "No space left on device")
    assert [p.name for p in disk.iterdir()] == ["filler"]
