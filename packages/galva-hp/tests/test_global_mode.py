"""Global mode: the reference runtime's flags give a validated uniform Strategy, and it trains like one process."""

from __future__ import annotations

import pytest

from galva_comm.testing import run_distributed
from galva_hp import BuildOptions, GlobalFlags, strategy_from_flags
from galva_hp.testing.models import tiny_llama
from galva_hp.testing.oracle import SEQ, VOCAB, reference_run, run_plan
from galva_schema import DataParallelType, PipelineSchedule


def test_flags_map_to_strategy() -> None:
    flags = GlobalFlags(
        world_size=8,
        num_layers=4,
        global_batch_size=16,
        pp=2,
        tp=2,
        tp_consecutive=False,
        sdp=True,
        chunks=4,
        checkpoint=True,
        pipeline_type="pipedream_flush",
        vocab_tp=4,
        mixed_precision="fp32",
    )
    s = strategy_from_flags(flags)
    assert (s.pp, s.pp_division, s.num_micro_batches) == (2, (2, 2), 4)
    assert s.pipeline_schedule is PipelineSchedule.ONE_F_ONE_B
    assert all(layer.tp == 2 and not layer.tp_consecutive and layer.checkpoint for layer in s.layers)
    assert s.default_dp_type is DataParallelType.ZERO3 and s.vocab.tp == 4
    assert s.layer_summary(0) == "2-2-2f-c"  # strided tp is honoured (the reference forced consecutive)


def test_bad_flags_name_the_field() -> None:
    with pytest.raises(ValueError, match="pipeline_type"):
        strategy_from_flags(GlobalFlags(world_size=4, num_layers=4, global_batch_size=8, pipeline_type="zb"))
    with pytest.raises(ValueError, match="tp"):
        strategy_from_flags(GlobalFlags(world_size=4, num_layers=4, global_batch_size=8, tp=3))


def make():
    return tiny_llama(vocab_size=VOCAB, layers=4)


def train_global(rank: int, world_size: int) -> dict[str, float]:
    flags = GlobalFlags(
        world_size=4,
        num_layers=4,
        global_batch_size=8,
        pp=2,
        tp=2,
        ulysses=True,
        default_dp_type="zero2",
        chunks=2,
        checkpoint=True,
        pipeline_type="gpipe",
        vocab_tp=2,
        vocab_sp=True,
        mixed_precision="fp32",
    )
    return run_plan(make, strategy_from_flags(flags), reference_run(make), BuildOptions(seq_len=SEQ))


@pytest.mark.distributed
def test_global_mode_trains_like_one_process() -> None:
    diff = run_distributed(train_global, 4, timeout=120)[0]
    assert max(diff["loss"], diff["norm"], diff["param"]) < 1e-5, diff
