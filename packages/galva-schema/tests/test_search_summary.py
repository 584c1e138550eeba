"""SearchSummary, the ``galva-search --summary-json`` file: summaries written before it was a class still read, bad
ones are one line naming the field, and a summary knows whether it belongs to a strategy."""

from __future__ import annotations

import json

import pytest

from galva_schema import SchemaError, SearchSummary, Strategy
from galva_schema.cli import validate_file

# What galva-search's json_summary wrote before the summary was a galva-schema class (the same keys, counts and the
# time breakdown as free dicts; an empty breakdown when the plan had no stage parts).
_WRITTEN_BEFORE = {
    "schema_version": 1,
    "kind": "galva.search_summary",
    "iteration_time_s": 0.5,
    "throughput_samples_per_s": 64.0,
    "global_batch_size": 32,
    "num_micro_batches": 4,
    "pp": 2,
    "pp_division": [2, 2],
    "pipeline_schedule": "1f1b",
    "virtual_stages": 1,
    "vocab": {"tp": 1, "sp": False, "dp_type": "ddp"},
    "memory_budget_mib": 20000.0,
    "usable_memory_mib": 19000.0,
    "stage_memory_mib": [15000.0, 14000.0],
    "stage_micro_batch_time_s": [0.1, 0.12],
    "time_breakdown_s": {"compute": 0.3, "tp": 0.05, "dp": 0.05, "p2p": 0.02, "redistribution": 0.0, "bubble": 0.08},
    "layer_runs": [{"stage": 0, "first": 0, "last": 1, "strategy": "2-1-8"}, {"stage": 1, "first": 2, "last": 3,
                                                                               "strategy": "2-1-8-c"}],
    "search_time_s": 1.5,
    "counts": {"tasks": 10, "solved": 6, "infeasible": 1, "pruned_bound": 2, "pruned_memory": 1, "dp_problems": 12,
               "dp_reused": 3},
}


def _strategy(**changes: object) -> Strategy:
    data = {"world_size": 4, "pp": 2, "pp_division": [2, 2], "num_micro_batches": 4, "global_batch_size": 32,
            "layers": [{"tp": 1}] * 4}
    return Strategy.from_dict({**data, **changes})


def test_a_summary_written_before_the_class_reads_and_round_trips(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(_WRITTEN_BEFORE))
    summary = SearchSummary.load(path)
    assert summary.counts.tasks == 10 and summary.counts.refined == 0
    assert summary.time_breakdown_s is not None and summary.time_breakdown_s.bubble == 0.08
    assert [run.strategy for run in summary.layer_runs] == ["2-1-8", "2-1-8-c"]
    assert isinstance(validate_file(path), SearchSummary)  # galva-schema validate knows the kind
    assert SearchSummary.from_dict(summary.to_dict()) == summary
    empty = SearchSummary.from_dict({**_WRITTEN_BEFORE, "time_breakdown_s": {}})
    assert empty.time_breakdown_s is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"stage_memory_mib": [1.0]}, "stage_memory_mib: 1 entries, expected one per stage (pp 2)"),
        ({"pp_division": [4]}, "pp_division: 1 entries, expected pp x virtual_stages = 2"),
        ({"iteration_time_s": "0.5"}, "iteration_time_s: expected a number, got \"0.5\""),
        ({"counts": {"tasks": 1, "tried": 2}}, "counts.tried"),
        ({"time_breakdown_s": {"compute": 1.0}}, "time_breakdown_s.tp"),
        ({"pipeline_schedule": "pipedream_flush"}, "pipeline_schedule"),
        ({"schema_version": 2}, "schema_version: this galva-schema reads version 1"),
    ],
)
def test_a_bad_summary_is_one_line_naming_the_field(tmp_path, change, expected):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({**_WRITTEN_BEFORE, **change}))
    with pytest.raises(SchemaError) as err:
        SearchSummary.load(path)
    message = str(err.value)
    assert "\n" not in message and expected in message and str(path) in message


def test_mismatch_names_the_first_plan_fact_the_strategy_contradicts():
    summary = SearchSummary.from_dict(_WRITTEN_BEFORE)
    assert summary.mismatch(_strategy()) is None
    assert summary.mismatch(_strategy(global_batch_size=64)) == "global_batch_size is 32, but 64"
    assert summary.mismatch(_strategy(num_micro_batches=8)) == "num_micro_batches is 4, but 8"
    assert summary.mismatch(_strategy(pp_division=[1, 3])) == "pp_division is [2, 2], but [1, 3]"
    other_model = _strategy(pp_division=[3, 3], layers=[{"tp": 1}] * 6)
    assert summary.mismatch(other_model) == "pp_division [2, 2] plans 4 layers, but the model has 6"
