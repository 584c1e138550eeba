"""The galva-schema command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from galva_schema import Strategy
from galva_schema.cli import main
from galva_schema.reference import read_galvatron_strategy

DATA = Path(__file__).parent / "data"
PIPELINE = DATA / "galvatron" / "strategies" / "galvatron_config_gpt-2.7b_1nodes_8gpus_per_node_40GB_bf16_example.json"
BAD = DATA / "malformed" / "strategy_tp_too_large.json"


def test_convert_both_ways_and_validate(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["convert", "--from-galvatron-strategy", str(PIPELINE), "--world-size", "8", "-o", str(plan)]) == 0
    assert Strategy.load(plan) == read_galvatron_strategy(PIPELINE, world_size=8)
    back = tmp_path / "galvatron_config.json"
    assert main(["convert", "--to-galvatron-strategy", str(plan), "-o", str(back)]) == 0
    original, written = json.loads(PIPELINE.read_text()), json.loads(back.read_text())
    assert {k: written[k] for k in original} == original
    capsys.readouterr()
    assert main(["validate", str(plan)]) == 0
    assert capsys.readouterr().out == f"{plan}: OK (galva.strategy)\n"


def test_validate_reports_one_line_per_bad_file_and_exits_1(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    Strategy.uniform(world_size=2, num_layers=2, global_batch_size=4).save(plan)
    assert main(["validate", str(plan), str(BAD), str(PIPELINE)]) == 1
    out, err = capsys.readouterr()
    assert out == f"{plan}: OK (galva.strategy)\n"
    lines = err.splitlines()
    assert len(lines) == 2
    assert lines[0] == f"galva-schema: error: {BAD}: layers[3].tp: 8 is larger than the 4 ranks of a pipeline stage"
    assert lines[1].startswith(f"galva-schema: error: {PIPELINE}: kind: missing") and "galva-schema convert" in lines[1]


def test_convert_errors_are_one_line(tmp_path, capsys):
    bad = DATA / "malformed" / "galvatron_config_context_parallel.json"
    out = tmp_path / "plan.json"
    assert main(["convert", "--from-galvatron-strategy", str(bad), "--world-size", "8", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("galva-schema: error: ") and "cp_sizes_enc[0..1]" in err
    assert not out.exists()
    with pytest.raises(SystemExit) as info:
        main(["convert", "-o", str(out)])  # neither direction given
    assert info.value.code == 2


def test_export_schemas_command(tmp_path, capsys):
    assert main(["export-schemas", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [
            "strategy.schema.json",
            "hardware_profile.schema.json",
            "model_profile.schema.json",
            "cluster.schema.json",
            "checkpoint_manifest.schema.json",
            "calibration.schema.json",
            "search_summary.schema.json",
            "run_check.schema.json",
        ]
    )


def test_console_script_is_installed(tmp_path):
    script = shutil.which("galva-schema", path=str(Path(sys.executable).parent))
    assert script, "the galva-schema console script is missing: re-run `bash tools/setup.sh`"
    result = subprocess.run([script, "validate", str(BAD)], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().endswith("layers[3].tp: 8 is larger than the 4 ranks of a pipeline stage")
