"""A uniform plan (one layer plan for every layer, as galva-train's global flags give) trains like one process."""

from __future__ import annotations

import pytest

from galva_comm.testing import run_distributed
from galva_hp import BuildOptions
from galva_hp.testing.models import tiny_llama
from galva_hp.testing.oracle import SEQ, VOCAB, reference_run, run_plan
from galva_schema import DataParallelType, PipelineSchedule, Precision, Strategy


def make():
    return tiny_llama(vocab_size=VOCAB, layers=4)


def train_global(rank: int, world_size: int) -> dict[str, float]:
    plan = Strategy.uniform(
        world_size=4,
        num_layers=4,
        global_batch_size=8,
        layer={"tp": 2, "ulysses": True, "checkpoint": True},
        pp=2,
        pipeline_schedule=PipelineSchedule.GPIPE,
        num_micro_batches=2,
        mixed_precision=Precision.FP32,
        default_dp_type=DataParallelType.ZERO2,
        vocab={"tp": 2, "sp": True},
    )
    return run_plan(make, plan, reference_run(make), BuildOptions(seq_len=SEQ))


@pytest.mark.distributed
def test_global_mode_trains_like_one_process() -> None:
    diff = run_distributed(train_global, 4, timeout=120)[0]
    assert max(diff["loss"], diff["norm"], diff["param"]) < 1e-5, diff
