"""Data parallelism, pipeline schedules, checkpointing and tied weights on a tiny model of plain torch modules.

The model needs no tensor parallelism (its parallelizer copies modules as they are), so every plan here uses
tp = 1; the tensor-parallel rows of the matrix live in test_matrix.py. Oracle: single-process fp32 training on the
same global batches; tolerance 1e-5 relative on losses, gradient norms and final parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from galva_comm.testing import run_distributed
from galva_hp import BuildOptions, GalvaOptimizer, ParallelContext, build, train_step
from galva_hp.model import LayeredModel
from galva_hp.shared_params import embedding_ties
from galva_hp.testing.oracle import OPTIM, SEQ, VOCAB, batch, reference_run, run_plan
from galva_schema import ParallelForm, Strategy
from galva_schema.constraints import uniform_constraints

HIDDEN, LAYERS, TOL = 32, 4, 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Head(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.proj.weight = embedding.weight  # tied in the single-process model

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(self.norm(hidden)).float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return loss, (labels != -100).sum()


class CopyParallelizer:
    """tp = 1 only: the parallel form is a copy of the module (so tied weights become two copies, as with TP)."""

    def layer(self, module: nn.Module, layer_type: str, ctx: ParallelContext) -> nn.Module:
        assert ctx.tp_size == 1 and ctx.sp_size == 1
        return copy.deepcopy(module)

    def embedding(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        return copy.deepcopy(module)

    def head(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        return copy.deepcopy(module)


def tiny_model() -> LayeredModel:
    torch.manual_seed(1234)
    embedding = nn.Embedding(VOCAB, HIDDEN)
    layers = [Block() for _ in range(LAYERS)]
    head = Head(embedding)
    return LayeredModel(
        embedding=embedding,
        layers=layers,
        head=head,
        layer_types=["block"] * LAYERS,
        parallelizer=CopyParallelizer(),
        shared=embedding_ties(embedding, head),
        name="tiny-block",
        constraints=uniform_constraints(
            "tiny-block",
            "block",
            LAYERS,
            num_heads=1,
            unsupported={form: "a copy-only test model" for form in (ParallelForm.TP, ParallelForm.ULYSSES)},
        ),
    )


def plan(**fields) -> Strategy:
    fields.setdefault("global_batch_size", 8)
    fields.setdefault("mixed_precision", "fp32")
    layers = fields.pop("layers", [{}] * LAYERS)
    return Strategy.model_validate({"world_size": 4, "layers": layers, **fields})


PLANS = {
    "dp4-ddp": plan(default_dp_type="ddp"),
    "dp4-zero2": plan(default_dp_type="zero2"),
    "dp4-zero3": plan(default_dp_type="zero3"),
    "dp4-zero3-2mb-every": plan(default_dp_type="zero3", num_micro_batches=2),
    "dp4-ddp-2mb-every": plan(default_dp_type="ddp", num_micro_batches=2),
    "dp4-mixed-ckpt": plan(
        layers=[
            {"dp_type": "ddp", "checkpoint": True},
            {"dp_type": "zero3"},
            {"dp_type": "zero2", "checkpoint": True},
            {"dp_type": "zero3"},
        ],
        num_micro_batches=2,
    ),
    "pp4-gpipe-1": plan(pp=4, pipeline_schedule="gpipe", num_micro_batches=1),
    "pp4-gpipe-2": plan(pp=4, pipeline_schedule="gpipe", num_micro_batches=2),
    "pp4-gpipe-4": plan(pp=4, pipeline_schedule="gpipe", num_micro_batches=4),
    "pp4-1f1b-1": plan(pp=4, pipeline_schedule="1f1b", num_micro_batches=1),
    "pp4-1f1b-2": plan(pp=4, pipeline_schedule="1f1b", num_micro_batches=2),
    "pp4-1f1b-4": plan(pp=4, pipeline_schedule="1f1b", num_micro_batches=4),
    "pp2-dp2-zero3-1f1b": plan(pp=2, default_dp_type="zero3", num_micro_batches=2, pp_division=[1, 3]),
}


def check_plans(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, float]]:
    ref = reference_run(tiny_model)
    out = {}
    for name in names:
        options = BuildOptions(seq_len=SEQ, reduce_every_micro_batch=name.endswith("every"))
        out[name] = run_plan(tiny_model, PLANS[name], ref, options)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("names", [[n for n in PLANS if n.startswith("dp")], [n for n in PLANS if n.startswith("pp")]])
def test_runtime_matches_single_process(names: list[str]) -> None:
    results = run_distributed(check_plans, 4, names, timeout=300)[0]
    for name, diff in results.items():
        assert diff["loss"] < TOL and diff["norm"] < TOL and diff["param"] < TOL, (name, diff)


def measured(rank: int, world_size: int) -> dict:
    strategy = plan(layers=[{"checkpoint": True}, {}, {}, {}], default_dp_type="zero3")
    model = build(tiny_model(), strategy, BuildOptions(seq_len=SEQ, measure_activations=True))
    optimizer = GalvaOptimizer(model.param_records(), OPTIM)
    ids, labels = batch(0)
    metrics = train_step(model, optimizer, ids[0], labels[0])
    head = next(u for u in model.units if u.name == "head")
    return {
        "saved": metrics.saved_activation_bytes, "ms": metrics.step_ms, "peak": metrics.peak_memory_mib,
        "records": [r.name for r in model.param_records()], "head": [n for n, _ in head.master_parameters()],
        "states": len(optimizer.optimizer.state),
    }  # fmt: skip


@pytest.mark.distributed
def test_step_metrics() -> None:
    result = run_distributed(measured, 4, timeout=60)[0]
    saved = result["saved"]
    # a checkpointed layer keeps only its input: [2 samples, 16, 32] fp32 = 4 KiB
    assert saved["layers.0"] == 2 * SEQ * HIDDEN * 4, saved
    assert saved["layers.1"] > 4 * saved["layers.0"], saved
    # the embedding keeps its own rank's 2 samples of ids, not a view of the global batch's 8 (a ViT's pixels)
    assert saved["embedding"] == 2 * SEQ * 8, saved
    assert set(saved) == {"embedding", "layers.0", "layers.1", "layers.2", "layers.3", "head"}
    assert result["ms"] > 0 and result["peak"] > 0
    # the tie on one stage (ZeRO-3): one tensor, the embedding's; the head's unit holds none, one set of AdamW states
    assert "embedding.weight" in result["records"] and "head.proj.weight" not in result["records"]
    assert "proj.weight" not in result["head"] and result["states"] == len(result["records"])
