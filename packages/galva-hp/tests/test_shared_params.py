"""A parameter shared by two layers (galva_hp.shared_params) trains like one process wherever the layers run.

Tiny GPT (4 layers) whose layers 1 and 2 both add one shared vector to their input (layer 1 registers it). Plans on
4 gloo ranks: the two layers on different pipeline stages under ZeRO-3 on one and ddp on the other, under tp 2
(the shift computed on every tp rank: ``replicated_over``) and Ulysses (on a sequence shard), under ZB-H1's split
backward (the readers on two stages, and both on the split stage), and on one stage with two tp layouts. Oracle:
single-process fp32 training (galva_hp.testing.oracle); tolerance 1e-5 relative on every step's loss and gradient
norm and on every final parameter, the shared vector included.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from galva_comm.testing import run_distributed
from galva_hp import ParallelContext
from galva_hp.model import LayeredModel
from galva_hp.shared_params import SharedWeight
from galva_hp.testing.models import TinyParallelizer, tiny_gpt
from galva_hp.testing.oracle import SEQ, VOCAB, reference_run, run_plan
from galva_schema import Strategy

TOL = 1e-5
USERS = (1, 2)


class Shifted(nn.Module):
    """``layer(x + shift)``; the home layer registers ``shift``, every reader reads it through ``shared``."""

    def __init__(self, layer: nn.Module, shared: SharedWeight | None, shift: nn.Parameter | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.shift = shift
        self._shared = (shared,)  # a tuple: not a module attribute to copy
        self.replicated_over = None

    def forward(self, x: Tensor) -> Tensor:
        shared = self._shared[0]
        assert shared is not None
        return self.layer(x + shared.value(self.replicated_over))


class ShiftedParallelizer(TinyParallelizer):
    def layer(self, module: nn.Module, layer_type: str, ctx: ParallelContext) -> nn.Module:
        if not isinstance(module, Shifted):
            return super().layer(module, layer_type, ctx)
        out = Shifted(super().layer(module.layer, layer_type, ctx), module._shared[0], module.shift)
        # plain tp: every tp rank adds the shift to the same full sequence; sharded boundaries: to its own tokens
        out.replicated_over = ctx.tp_group if ctx.tp_size > 1 and not ctx.seq_sharded else None
        return out


def shifted_gpt() -> LayeredModel:
    model = tiny_gpt(vocab_size=VOCAB, hidden=32, heads=4, layers=4, seq_len=SEQ)
    shift = nn.Parameter(0.1 * torch.randn(32, generator=torch.Generator().manual_seed(7)))
    shared = SharedWeight("shift", shift, home=USERS[0], path="shift", users=USERS)
    for index in USERS:
        model.layers[index] = Shifted(model.layers[index], shared, shift if index == USERS[0] else None)
    model.parallelizer = ShiftedParallelizer(4, 4)
    model.shared.append(shared)  # beside the embedding-to-head tie: one mechanism
    return model


def _plan(layers: list[dict], **fields) -> Strategy:
    base = {"world_size": 4, "global_batch_size": 8, "num_micro_batches": 2, "mixed_precision": "fp32"}
    return Strategy.model_validate({**base, "layers": layers, **fields})


PLANS = {
    # layer 1 on stage 0 under ZeRO-3, layer 2 on stage 1 under ddp (dp 2 each)
    "pp2-zero3|ddp": _plan([{}, {"dp_type": "zero3"}, {"dp_type": "ddp"}, {}], pp=2),
    # the same with tp 2 on stage 0 (the shift replicated over tp) and Ulysses 2 on stage 1 (on a sequence shard)
    "pp2-tp2|ulysses2-zero3": _plan(
        [{}, {"tp": 2}, {"tp": 2, "ulysses": True, "dp_type": "zero3"}, {}], pp=2, pipeline_schedule="gpipe"
    ),
    # the split backward of zero-bubble H1 (the copy is a leaf of the chunk's graph: its W step fills it)
    "pp2-zero3|tp2-zb_h1": _plan([{}, {"dp_type": "zero3"}, {"tp": 2}, {}], pp=2, pipeline_schedule="zb-h1"),
    # ZB-H1 with both readers on the split stage: the copy's gradient meets the input-gradient path in both layers,
    # one behind the other; the I step takes it (a W step would run layer 2's backward again, on freed tensors)
    "pp2-ddp|both-readers-tp2-zb_h1": _plan(
        [{}, {}, {"tp": 2}, {}], pp=2, pp_division=[1, 3], pipeline_schedule="zb-h1", num_micro_batches=4
    ),
    # one stage, two layouts: tp 2 with Megatron-SP under ZeRO-3 (dp 2), then tp 4 under ddp
    "pp1-tp2-megatron_sp-zero3|tp4": _plan([{}, {"tp": 2, "dp_type": "zero3"}, {"tp": 4}, {}], megatron_sp=True),
}


def check_plans(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, float]]:
    ref = reference_run(shifted_gpt)
    return {name: run_plan(shifted_gpt, PLANS[name], ref) for name in names}


@pytest.mark.distributed
def test_a_parameter_shared_across_stages_and_layouts_trains_like_one_process():
    results = run_distributed(check_plans, 4, list(PLANS), timeout=300)
    for name, diffs in results[0].items():
        for key, diff in diffs.items():
            assert diff < TOL, f"{name}: {key} differs from the single process by {diff:.2e}"


def test_a_shared_weight_names_its_home_among_its_users():
    with pytest.raises(ValueError, match=r"home layers\.3 is not one of its users"):
        SharedWeight("x", nn.Parameter(torch.zeros(2)), home=3, path="x", users=(1, 2))
