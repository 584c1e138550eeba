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
