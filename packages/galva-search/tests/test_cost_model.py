"""Cost-model values on hand-computed cases: every term of docs/cost-model.md at least once.

The tiny cluster (conftest.tiny_hardware): 4 devices, consecutive groups 100 GB/s (size 2: 200 GB/s), strided 50 GB/s,
p2p 25 GB/s, overlap slowdown 1.25. The tiny layer: H 1024, S 512, 64 MiB fp32 parameters (16 Mi parameters),
2 ms forward per sample, activation {1: 10, 2: 6, 4: 4} MiB per sample, checkpoint 1 MiB per sample; bf16.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from galva_schema import (
    CallExtra,
    CollectiveTimes,
    DataParallelType,
    HardwareProfile,
    ModelProfile,
    PipelineSchedule,
    Precision,
    SchemaError,
    StaticTime,
)
from galva_search.collectives import Collectives
from galva_search.cost_model import CostModel, CostSettings, VocabOption, pipeline_time
from galva_search.cost_settings import TermFactors
from galva_search.space import Candidate

DDP, ZERO2, ZERO3 = DataParallelType.DDP, DataParallelType.ZERO2, DataParallelType.ZERO3
EXACT = {"rel": 1e-12, "abs": 1e-18}
S, H, E = 512, 1024, 2  # sequence, hidden, bytes per bf16 element
GRAD_BYTES = 64 * 2**20 / 4 * E  # 16 Mi parameters in bf16 (the reference's accounting reduces bf16 gradients)


def terms(model, hw, cand, micro=8, c=1, **settings):
    cost = CostModel(hw, model, CostSettings(**settings))
    return cost.layer_terms(0, [cand], micro, c), cost


# ------------------------------------------------------------------------------------------------ collectives
def test_allreduce_uses_bus_bandwidth_in_decimal_gigabytes(tiny_hw):
    comm = Collectives(tiny_hw)
    nbytes = 1e9
    assert float(comm.allreduce(4, True, nbytes)) == pytest.approx(2 * 3 / 4 * 1e9 / 100e9, **EXACT)
    assert float(comm.allreduce(2, False, nbytes)) == pytest.approx(2 * 1 / 2 * 1e9 / 50e9, **EXACT)
    assert float(comm.reduce_scatter(2, True, nbytes)) == pytest.approx(0.5 * 1e9 / 200e9, **EXACT)
    assert float(comm.all_gather(2, True, nbytes)) == pytest.approx(0.5 * 1e9 / 200e9, **EXACT)
    assert float(comm.all_to_all(4, True, nbytes)) == pytest.approx(3 / 4 * 1e9 / 100e9, **EXACT)
    assert float(comm.p2p(2, nbytes)) == pytest.approx(1e9 / 25e9, **EXACT)
    assert float(comm.allreduce(1, True, nbytes)) == 0.0
    assert float(comm.p2p(1, nbytes)) == 0.0


def test_measured_curves_interpolate_inside_and_fit_outside(tiny_hw):
    curve = CollectiveTimes(group_size=4, message_mib=(1.0, 2.0, 4.0), time_ms=(1.0, 1.5, 3.5))
    hw = tiny_hw.model_copy(update={"allreduce_time": (curve,), "all_to_all_time": (curve,)})
    comm = Collectives(hw)
    mib = 2**20
    assert float(comm.allreduce(4, True, 3 * mib)) == pytest.approx(2.5e-3, **EXACT)  # between 2 and 4 MiB
    assert float(comm.all_to_all(4, True, 1.5 * mib)) == pytest.approx(1.25e-3, **EXACT)
    slope, intercept = curve.linear_fit()
    assert float(comm.allreduce(4, True, 8 * mib)) == pytest.approx((slope * 8 + intercept) * 1e-3, **EXACT)
    # below the smallest size an all-to-all is latency-bound: that size's time, where the line falls below it
    line = max(0.0, slope * 0.25 + intercept) * 1e-3
    assert line < 1e-3 and float(comm.allreduce(4, True, 0.25 * mib)) == pytest.approx(line, **EXACT)
    assert float(comm.all_to_all(4, True, 0.25 * mib)) == pytest.approx(1e-3, **EXACT)
    # strided groups have no curve: bus bandwidth
    assert float(comm.allreduce(2, False, mib)) == pytest.approx(mib / 50e9, **EXACT)


def test_every_collective_call_pays_the_profiles_busy_extra_once(tiny, tiny_hw):
    """A call inside a busy step costs its idle time plus the profile's ``call_extra`` of its kind and group size:
    once per call, whatever its size; nothing for a group of one, an empty message or an older profile."""
    extras = tuple(
        CallExtra(group_size=2, collective=kind, ms=ms)
        for kind, ms in (("all_reduce", 1.0), ("all_gather", 2.0), ("reduce_scatter", 3.0), ("all_to_all", 4.0))
    )
    hw = tiny_hw.model_copy(update={"call_extra": extras})
    idle, busy = Collectives(tiny_hw), Collectives(hw)
    sizes = np.array([0.0, 4096.0, 2.0**20])
    for method, ms in (("allreduce", 1.0), ("all_gather", 2.0), ("reduce_scatter", 3.0), ("all_to_all", 4.0)):
        got = getattr(busy, method)(2, True, sizes) - getattr(idle, method)(2, True, sizes)
        assert got == pytest.approx([0.0, ms * 1e-3, ms * 1e-3], **EXACT), method
        assert float(getattr(busy, method)(1, True, 4096.0)) == 0.0
    assert float(busy.allreduce(4, True, 4096.0)) == float(idle.allreduce(4, True, 4096.0))  # none for groups of 4
    # priced per call the runtime makes: Megatron tp's 4 all-reduces a layer, 5 checkpointed
    for checkpoint, calls in ((False, 4), (True, 5)):
        plain, _ = terms(tiny, tiny_hw, Candidate(1, 2, 2, consecutive=True, checkpoint=checkpoint))
        extra, _ = terms(tiny, hw, Candidate(1, 2, 2, consecutive=True, checkpoint=checkpoint))
        assert extra.tp_comm_s[0] - plain.tp_comm_s[0] == pytest.approx(calls * 1e-3, **EXACT)


def test_megatron_sp_all_gathers_right_after_a_reduce_scatter_cost_their_idle_curve(make_model, tiny_hw):
    """Megatron-SP's all-gathers follow a reduce-scatter over the same group with only a norm between, so their ranks
    arrive together: the busy extra falls on its 4 reduce-scatters a layer (5 recomputing) and on one all-gather, the
    backward's first after the recomputed MLP, when checkpointed; none on the other all-gathers."""
    extras = tuple(
        CallExtra(group_size=2, collective=kind, ms=ms) for kind, ms in (("all_gather", 2.0), ("reduce_scatter", 3.0))
    )
    hw = tiny_hw.model_copy(update={"call_extra": extras})
    sp = make_model(megatron_sp=True)
    for checkpoint, busy_ms in ((False, 4 * 3.0), (True, 5 * 3.0 + 1 * 2.0)):
        candidate = Candidate(1, 2, 2, consecutive=True, checkpoint=checkpoint)
        plain, _ = terms(sp, tiny_hw, candidate, megatron_sp=True)
        extra, _ = terms(sp, hw, candidate, megatron_sp=True)
        assert extra.tp_comm_s[0] - plain.tp_comm_s[0] == pytest.approx(busy_ms * 1e-3, **EXACT), checkpoint


def test_a_pipeline_send_pays_the_profiles_busy_send_extra(tiny, tiny_hw):
    """A send to a waiting receiver costs the idle latency plus the profile's ``call_extra`` of ``"p2p"`` at that
    pipeline degree: in every layer's p2p term at that degree, nowhere without a pipeline or at another degree."""
    hw = tiny_hw.model_copy(update={"call_extra": (CallExtra(group_size=2, collective="p2p", ms=1.5),)})
    idle, busy = Collectives(tiny_hw), Collectives(hw)
    assert busy.p2p_latency(2) - idle.p2p_latency(2) == pytest.approx(1.5e-3, **EXACT)
    assert busy.p2p_latency(1) == 0.0 and busy.p2p_latency(4) == idle.p2p_latency(4)
    plain, _ = terms(tiny, tiny_hw, Candidate(2, 1, 2))
    extra, _ = terms(tiny, hw, Candidate(2, 1, 2))
    assert extra.p2p_s[0] - plain.p2p_s[0] == pytest.approx(1.5e-3, **EXACT)


def test_overlap_slows_both_while_they_overlap(tiny_hw):
    comm = Collectives(tiny_hw)  # slowdown 1.25
    assert float(comm.overlapped(8.0, 2.0)) == pytest.approx(2.0 * 1.25 + 6.0)
    assert float(comm.overlapped(2.0, 8.0)) == pytest.approx(2.0 * 1.25 + 6.0)
    assert float(comm.overlapped(3.0, 0.0)) == 3.0


def test_missing_bandwidth_entry_names_file_and_key(tiny_hw, tiny):
    hw = tiny_hw.model_copy(update={"allreduce": tuple(e for e in tiny_hw.allreduce if e.group_size != 2)})
    cost = CostModel(hw, tiny, hardware_source="hw.json")
    expected = r"^hw.json: allreduce: no entry for group_size 2 \((strided|consecutive)\); the search needs it"
    with pytest.raises(SchemaError, match=expected):
        cost.layer_terms(0, [Candidate(1, 2, 2)], 8, 1)


# ------------------------------------------------------------------------------------------------ layer time
def test_compute_forward_backward_and_recompute(tiny, tiny_hw):
    t, _ = terms(tiny, tiny_hw, Candidate(1, 1, 4))  # 2 samples per rank
    assert t.forward_s[0] == pytest.approx(0.004, **EXACT)
    assert t.backward_s[0] == pytest.approx(0.008, **EXACT)
    t, _ = terms(tiny, tiny_hw, Candidate(1, 1, 4, checkpoint=True))
    assert t.backward_s[0] == pytest.approx(0.012, **EXACT)  # + one recomputed forward
    t, _ = terms(tiny, tiny_hw, Candidate(1, 1, 4), backward_coefficient=3.0)
    assert t.backward_s[0] == pytest.approx(0.012, **EXACT)


def test_ddp_gradient_sync_is_once_per_iteration_and_overlapped(tiny, tiny_hw):
    t, _ = terms(tiny, tiny_hw, Candidate(1, 1, 4), state_accounting="reference")
    sync = 2 * 3 / 4 * GRAD_BYTES / 100e9
    assert t.grad_sync_s[0] == pytest.approx(sync, **EXACT)
    assert t.micro_batch_s[0] == pytest.approx(0.012, **EXACT)  # no sync inside a micro-batch
    assert t.exposed_sync_s[0] == pytest.approx(sync * 0.25, **EXACT)  # overlapped with 8 ms of backward
    assert t.tp_comm_s[0] == 0.0


def test_galva_hp_reduces_gradients_in_fp32_and_gathers_the_bf16_copy(tiny, tiny_hw):
    """galva-hp keeps a bf16 plan's gradients in fp32 and reduces them so (DDP into the fp32 master's gradient,
    FSDP2's reduce dtype): its gradient sync moves twice the reference's bf16 bytes; ZeRO-3's all-gathers move the
    bf16 compute copy, the same bytes under both accountings."""
    ref, _ = terms(tiny, tiny_hw, Candidate(1, 1, 4), state_accounting="reference")
    hp, _ = terms(tiny, tiny_hw, Candidate(1, 1, 4), state_accounting="galva-hp")
    assert hp.grad_sync_s[0] == pytest.approx(2 * ref.grad_sync_s[0], **EXACT)
    ref, _ = terms(tiny, tiny_hw, Candidate(1, 1, 4, dp_type=ZERO3), state_accounting="reference")
    hp, _ = terms(tiny, tiny_hw, Candidate(1, 1, 4, dp_type=ZERO3), state_accounting="galva-hp")
    gather = 3 / 4 * GRAD_BYTES / 100e9  # all-gather of the bf16 copy: half a ring all-reduce of it
    assert ref.grad_sync_s[0] == pytest.approx(2 * gather, **EXACT)  # reduce-scatter + all-gather, both bf16
    assert hp.grad_sync_s[0] == pytest.approx(2 * gather + gather, **EXACT)  # fp32 reduce-scatter + bf16 gather


def test_zero3_gathers_every_micro_batch_and_reduce_scatters_once(tiny, tiny_hw):
    """FSDP2 runs ZeRO-3's all-gathers in every micro-batch but its reduce-scatter only in the last one (galva-hp
    turns gradient sync off before it). So a micro-batch pays the forward all-gather (exposed) and the backward
    all-gather overlapped with 8 ms of backward (sigma 1.25: 0.125 sync); the reduce-scatter is once per iteration,
    overlapped with the last backward together with that all-gather. (Before, every micro-batch paid both, 0.75 sync,
    and nothing was left per iteration: with c = 1 the two give the same total, 0.75 sync.)"""
    t, _ = terms(tiny, tiny_hw, Candidate(1, 1, 4, dp_type=ZERO3), state_accounting="reference")
    sync = 2 * 3 / 4 * GRAD_BYTES / 100e9
    assert t.zero3_comm_s[0] == pytest.approx(0.5 * sync + 0.125 * sync, **EXACT)
    assert t.micro_batch_s[0] == pytest.approx(0.012 + 0.625 * sync, **EXACT)
    assert t.exposed_sync_s[0] == pytest.approx(0.125 * sync, **EXACT)  # ov(8 ms, sync) - ov(8 ms, sync / 2)
    assert t.micro_batch_s[0] + t.exposed_sync_s[0] == pytest.approx(0.012 + 0.75 * sync, **EXACT)


def test_megatron_tp_collectives_and_strided_dp_group(tiny, tiny_hw):
    # 4 samples per rank, x = 2
    t, _ = terms(tiny, tiny_hw, Candidate(1, 2, 2, consecutive=True), state_accounting="reference")
    act_bytes = 4 * S * H * E
    per = 2 * 1 / 2 * act_bytes / 200e9
    assert t.forward_s[0] == pytest.approx(0.004, **EXACT)
    assert t.tp_comm_s[0] == pytest.approx(4 * per, **EXACT)
    assert t.grad_sync_s[0] == pytest.approx(2 * 1 / 2 * GRAD_BYTES / 2 / 50e9, **EXACT)  # strided dp group
    t, _ = terms(tiny, tiny_hw, Candidate(1, 2, 2, consecutive=True, checkpoint=True))
    assert t.tp_comm_s[0] == pytest.approx(5 * per, **EXACT)  # the recomputation stops before the last one
    t, _ = terms(tiny, tiny_hw, Candidate(1, 2, 2, consecutive=False), state_accounting="reference")
    assert t.tp_comm_s[0] == pytest.approx(4 * act_bytes / 50e9, **EXACT)  # strided tp group
    assert t.grad_sync_s[0] == pytest.approx(GRAD_BYTES / 2 / 200e9, **EXACT)  # consecutive dp group


def test_megatron_sp_moves_the_same_volume(make_model, tiny_hw):
    plain, _ = terms(make_model(), tiny_hw, Candidate(1, 2, 2))
    sp, _ = terms(make_model(megatron_sp=True), tiny_hw, Candidate(1, 2, 2), megatron_sp=True)
    assert sp.tp_comm_s[0] == pytest.approx(plain.tp_comm_s[0], **EXACT)
    # checkpointed: galva-hp's recomputation repeats 2 all-gathers and 1 reduce-scatter (each half an all-reduce here)
    plain, _ = terms(make_model(), tiny_hw, Candidate(1, 2, 2, checkpoint=True))
    sp, _ = terms(make_model(megatron_sp=True), tiny_hw, Candidate(1, 2, 2, checkpoint=True), megatron_sp=True)
    assert sp.tp_comm_s[0] == pytest.approx(plain.tp_comm_s[0] * 5.5 / 5, **EXACT)


def test_ulysses_all_to_alls_on_the_sequence_shard(tiny, tiny_hw):
    t, _ = terms(tiny, tiny_hw, Candidate(1, 2, 2, ulysses=True), state_accounting="reference")
    buffer = 4 * S * H * E / 2
    assert t.tp_comm_s[0] == pytest.approx(8 * (1 / 2) * buffer / 200e9, **EXACT)
    # states are replicated over the sp group and synchronised over dp * sp = 4 consecutive ranks
    assert t.grad_sync_s[0] == pytest.approx(2 * 3 / 4 * GRAD_BYTES / 100e9, **EXACT)
    t, _ = terms(tiny, tiny_hw, Candidate(1, 2, 2, ulysses=True, checkpoint=True))
    assert t.tp_comm_s[0] == pytest.approx(12 * (1 / 2) * buffer / 200e9, **EXACT)


def test_p2p_of_the_stage_boundary(tiny, tiny_hw):
    t, _ = terms(tiny, tiny_hw, Candidate(2, 1, 2))
    assert t.p2p_s[0] == pytest.approx(4 * S * H * E / 25e9, **EXACT)
    t, _ = terms(tiny, tiny_hw, Candidate(1, 1, 4))
    assert t.p2p_s[0] == 0.0


# ------------------------------------------------------------------------------------------------ layer memory
@pytest.mark.parametrize(
    ("dp_type", "c", "fraction"),
    [
        (DDP, 1, 16 / 16),
        (ZERO2, 1, (2 + 2 / 2 + 12 / 2) / 16),
        (ZERO2, 4, (2 + 2 + 12 / 2) / 16),  # gradients accumulate in a full buffer
        (ZERO3, 1, (2 / 2 + 2 / 2 + 12 / 2) / 16),
        (ZERO3, 4, (2 / 2 + 2 + 12 / 2) / 16),
    ],
)
def test_model_states_by_dp_type(tiny, tiny_hw, dp_type, c, fraction):
    """The reference's formulas (bf16 gradients); galva-hp's own bytes are pinned at the end of this file."""
    t, _ = terms(tiny, tiny_hw, Candidate(1, 2, 2, dp_type=dp_type), c=c, state_accounting="reference")
    assert t.states_mib[0] == pytest.approx(64 / 2 / 4 * 16 * fraction, **EXACT)


def test_fp32_states_have_no_master_copy(make_model, tiny_hw):
    t, _ = terms(make_model(precision="fp32"), tiny_hw, Candidate(1, 1, 4, dp_type=ZERO2), precision=Precision.FP32)
    assert t.states_mib[0] == pytest.approx(64 / 4 * (4 + 4 / 4 + 8 / 4), **EXACT)


def test_activation_by_tp_checkpoint_sp_and_ulysses(make_model, tiny_hw):
    tiny = make_model()
    assert terms(tiny, tiny_hw, Candidate(1, 1, 4))[0].activation_mib[0] == pytest.approx(2 * 10.0)
    assert terms(tiny, tiny_hw, Candidate(1, 2, 2))[0].activation_mib[0] == pytest.approx(4 * 6.0)
    assert terms(tiny, tiny_hw, Candidate(1, 2, 2, checkpoint=True))[0].activation_mib[0] == pytest.approx(4 * 1.0)
    assert terms(tiny, tiny_hw, Candidate(1, 2, 2, ulysses=True))[0].activation_mib[0] == pytest.approx(4 * 10 / 2)
    sp = make_model(megatron_sp=True)
    got = terms(sp, tiny_hw, Candidate(1, 2, 2, checkpoint=True), megatron_sp=True)[0].activation_mib[0]
    assert got == pytest.approx(4 * 1.0 / 2)  # the checkpointed input is sequence-sharded


def test_a_parallel_forms_measured_overhead_is_compute(make_model, tiny_hw):
    """parallel_overhead_ms[form][degree] adds (forward, backward) ms per call to a layer under that form, scaled as
    compute; recomputation repeats the forward's; tp 1, other degrees and zb-h1's deferred share are unchanged."""
    plain = make_model()
    layer = plain.layer_types[0].model_copy(
        update={"parallel_overhead_ms": {"tp": {2: (1.0, 3.0)}, "ulysses": {2: (0.5, 0.25)}}})
    measured = plain.model_copy(update={"layer_types": (layer,)})
    cands = [Candidate(1, 1, 4), Candidate(1, 2, 2), Candidate(1, 2, 2, checkpoint=True),
             Candidate(1, 2, 2, ulysses=True), Candidate(1, 4, 1)]
    base = CostModel(tiny_hw, plain, CostSettings()).layer_terms(0, cands, 8, 1)
    got = CostModel(tiny_hw, measured, CostSettings()).layer_terms(0, cands, 8, 1)
    k = 1e-3 * CostSettings().factors.compute * tiny_hw.compute_slowdown
    extra_f, extra_b = np.array([0, 1.0, 1.0, 0.5, 0]) * k, np.array([0, 3.0, 4.0, 0.25, 0]) * k
    assert got.forward_s - base.forward_s == pytest.approx(extra_f, **EXACT)
    assert got.backward_s - base.backward_s == pytest.approx(extra_b, **EXACT)
    assert got.micro_batch_s - base.micro_batch_s == pytest.approx(extra_f + extra_b, **EXACT)
    assert got.weight_grad_s == pytest.approx(base.weight_grad_s, **EXACT)


def test_compute_is_priced_in_the_hardware_profile_s_minutes_through_the_reference_matmul(make_model, tiny_hw):
    """Where both profiles timed the reference matmul, every profiled compute time (the layers' passes, the
    vocabulary's, the optimizer's per-call work) is scaled by hardware / model: a model profile whose reference read
    twice the hardware profile's was timed while the machine ran at half speed. Only one of the two: unchanged."""
    from galva_schema import Strategy
    from galva_search.evaluation import evaluate_strategy

    plain = make_model().model_copy(update={"optimizer_call_ms": 2.0})
    slow = plain.model_copy(update={"compute_reference_ms": 2.0})
    hw = tiny_hw.model_copy(update={"optimizer_ms_per_million_parameters": 0.0})  # every rank's rate: not scaled
    timed = hw.model_copy(update={"compute_reference_ms": 1.0})
    cands = [Candidate(1, 1, 4), Candidate(1, 2, 2), Candidate(1, 1, 4, checkpoint=True)]
    base = CostModel(hw, plain, CostSettings()).layer_terms(0, cands, 8, 1)
    got = CostModel(timed, slow, CostSettings()).layer_terms(0, cands, 8, 1)
    compute = CostModel(hw, plain, CostSettings(factors=TermFactors(dp_comm=0.0, tp_comm=0.0)))
    halved = CostModel(timed, slow, CostSettings(factors=TermFactors(dp_comm=0.0, tp_comm=0.0)))
    assert got.forward_s[0] == pytest.approx(base.forward_s[0] / 2, **EXACT)  # one rank's whole layer: compute
    assert got.backward_s[0] == pytest.approx(base.backward_s[0] / 2, **EXACT)
    assert halved.layer_terms(0, cands, 8, 1).micro_batch_s == pytest.approx(
        compute.layer_terms(0, cands, 8, 1).micro_batch_s / 2, **EXACT)
    assert halved.optimizer_call_s() == pytest.approx(compute.optimizer_call_s() / 2, **EXACT)
    strategy = Strategy.uniform(world_size=4, num_layers=plain.layer_types[0].num_layers, global_batch_size=8)
    whole = evaluate_strategy(compute, strategy).iteration_time_s
    assert evaluate_strategy(halved, strategy).iteration_time_s == pytest.approx(whole / 2, rel=1e-9)
    for one, model in ((timed, plain), (hw, slow)):  # one side alone says nothing of the minutes
        assert CostModel(one, model, CostSettings()).layer_terms(0, cands, 8, 1).forward_s == pytest.approx(
            base.forward_s, **EXACT)


def test_a_zero_layers_measured_overhead_per_call_and_per_step(make_model, tiny_hw):
    """sharded_overhead_ms[dp type][degree] = (forward, backward, step) ms: forward and backward per micro-batch,
    scaled as compute and not recomputed (FSDP2's hooks are on the unit); the step once per iteration, in the
    optimizer's time; a sharding degree without an entry takes the largest profiled one below it; ddp, a one-rank
    group and tp forms are unchanged."""
    from galva_schema import LayerStrategy, Strategy
    from galva_search.evaluation import evaluate_strategy

    plain = make_model()
    layer = plain.layer_types[0].model_copy(
        update={"sharded_overhead_ms": {"zero3": {2: (1.0, 2.0, 0.5)}, "zero2": {2: (0.25, 0.5, 4.0)}}})
    measured = plain.model_copy(update={"layer_types": (layer,)})
    cands = [Candidate(1, 1, 4), Candidate(1, 1, 4, dp_type=ZERO3), Candidate(1, 1, 4, dp_type=ZERO3, checkpoint=True),
             Candidate(1, 2, 2, dp_type=ZERO2), Candidate(1, 4, 1, dp_type=ZERO3)]
    base = CostModel(tiny_hw, plain, CostSettings()).layer_terms(0, cands, 8, 2)
    got = CostModel(tiny_hw, measured, CostSettings()).layer_terms(0, cands, 8, 2)
    k = 1e-3 * CostSettings().factors.compute * tiny_hw.compute_slowdown
    # degree 4 (sharding over the whole stage) takes the degree-2 entry; tp 4 leaves one rank to shard over
    extra_f, extra_b = np.array([0, 1.0, 1.0, 0.25, 0]) * k, np.array([0, 2.0, 2.0, 0.5, 0]) * k
    assert got.forward_s - base.forward_s == pytest.approx(extra_f, **EXACT)
    assert got.backward_s - base.backward_s == pytest.approx(extra_b, **EXACT)  # recomputation adds none
    assert got.step_s == pytest.approx(np.array([0, 0.5, 0.5, 4.0, 0]) * k, **EXACT)
    assert len(base.step_s) == len(cands) and not base.step_s.any()
    strategy = Strategy(world_size=4, pp=1, pp_division=[4], global_batch_size=8, num_micro_batches=1,
                        mixed_precision="bf16", layers=[LayerStrategy(tp=1, dp_type="zero3")] * 4)
    before = evaluate_strategy(CostModel(tiny_hw, plain, CostSettings()), strategy)
    after = evaluate_strategy(CostModel(tiny_hw, measured, CostSettings()), strategy)
    assert after.detail.optimizer_s - before.detail.optimizer_s == pytest.approx(4 * 0.5 * k)
    assert after.iteration_time_s - before.iteration_time_s == pytest.approx(4 * (1.0 + 2.0 + 0.5) * k)


def test_a_zero_layers_accumulating_backward_prices_every_micro_batch_but_the_last(make_model, tiny_hw):
    """sharded_accumulate_ms[dp type][degree] = a ZeRO backward's overhead with gradient sync off: with several
    micro-batches each backward pays it and the last one the reducing backward's surplus as well, once per
    iteration (in the sync it hides): the last micro-batch costs what it did, every other one less. One
    micro-batch, ddp, or a profile without it: unchanged."""
    from galva_schema import LayerStrategy, Strategy
    from galva_search.evaluation import evaluate_strategy

    plain = make_model()
    reducing = plain.layer_types[0].model_copy(
        update={"sharded_overhead_ms": {"zero3": {2: (1.0, 2.0, 0.0)}, "zero2": {2: (0.25, 3.0, 0.0)}}})
    accumulating = reducing.model_copy(update={"sharded_accumulate_ms": {"zero3": {2: 0.5}, "zero2": {2: 1.0}}})
    models = [plain.model_copy(update={"layer_types": (layer,)}) for layer in (reducing, accumulating)]
    cands = [Candidate(1, 1, 4), Candidate(1, 1, 4, dp_type=ZERO2), Candidate(1, 1, 4, dp_type=ZERO3)]
    k = 1e-3 * CostSettings().factors.compute * tiny_hw.compute_slowdown

    def terms(model: Any, micro_batches: int) -> Any:
        return CostModel(tiny_hw, model, CostSettings()).layer_terms(0, cands, 8, micro_batches)

    one = [terms(m, 1) for m in models]
    assert one[1].backward_s == pytest.approx(one[0].backward_s, **EXACT)
    assert one[1].exposed_sync_s == pytest.approx(one[0].exposed_sync_s, **EXACT)
    two = [terms(m, 2) for m in models]
    assert two[0].backward_s - two[1].backward_s == pytest.approx(np.array([0, 2.0, 1.5]) * k, **EXACT)
    assert (two[0].micro_batch_s - two[1].micro_batch_s > np.array([-1e-12, 0.0, 0.0])).all()
    last = [t.micro_batch_s + t.exposed_sync_s for t in two]
    assert last[1] == pytest.approx(last[0], **EXACT)
    strategy = Strategy(world_size=4, pp=1, pp_division=[4], global_batch_size=16, num_micro_batches=2,
                        mixed_precision="bf16", layers=[LayerStrategy(tp=1, dp_type="zero2")] * 4)
    before, after = (evaluate_strategy(CostModel(tiny_hw, m, CostSettings()), strategy) for m in models)
    # 4 layers, the first of 2 micro-batches each 3 - 1 ms cheaper
    assert before.iteration_time_s - after.iteration_time_s == pytest.approx(4 * 2.0 * k)


def test_a_measured_backward_and_optimizer_step_replace_the_coefficient_and_the_rate(make_model, tiny_hw):
    """backward_time prices the layers' and the vocabulary's backward where profiled (recomputation repeats the
    forward, zb-h1's share is of it); optimizer_step_ms prices each layer's part of the step, a fixed part whatever
    its shards and a part per element of the rank's shard (tp, ZeRO), the vocabulary's likewise and the call's own
    once per stage, in place of the hardware's rate per parameter."""
    from galva_schema import BatchTime, LayerStrategy, Strategy
    from galva_search.evaluation import evaluate_strategy

    plain = make_model(precision="fp32")
    layer = plain.layer_types[0].model_copy(update={
        "backward_time": BatchTime(slope_ms_per_sample=3.0, intercept_ms=1.0), "optimizer_step_ms": (0.5, 2.0)})
    vocab = plain.vocab.model_copy(update={"backward_time": StaticTime(ms_per_sample=0.5),
                                           "optimizer_step_ms": (0.25, 4.0)})
    measured = plain.model_copy(update={"layer_types": (layer,), "vocab": vocab, "optimizer_call_ms": 1.5})
    cands = [Candidate(1, 1, 4), Candidate(1, 2, 2), Candidate(1, 1, 4, checkpoint=True),
             Candidate(1, 1, 4, dp_type=ZERO3)]
    k = 1e-3 * CostSettings().factors.compute * tiny_hw.compute_slowdown
    got = CostModel(tiny_hw, measured, CostSettings()).layer_terms(0, cands, 8, 1)
    base = CostModel(tiny_hw, plain, CostSettings()).layer_terms(0, cands, 8, 1)
    assert got.forward_s == pytest.approx(base.forward_s, **EXACT)
    # 2 samples' work per rank (tp 2 over dp 2: 4 samples, half of each): 3 * 2 + 1; a checkpointed layer adds its
    # 4 ms forward again
    assert got.backward_s == pytest.approx(np.array([7.0, 7.0, 11.0, 7.0]) * k, **EXACT)
    assert got.weight_grad_s == pytest.approx(0.5 * np.array([7.0, 7.0, 7.0, 7.0]) * k, **EXACT)
    million = 64 * 2**20 / 4 / 1e6  # the layer's parameters: the tp 2 and the ZeRO-3 (over 4) ranks step a share
    assert got.step_s == pytest.approx((0.5 + 2.0 * million / np.array([1, 2, 1, 4])) * k, **EXACT)
    assert not base.step_s.any()
    vocab_terms = CostModel(tiny_hw, measured, CostSettings()).vocab_terms(1, VocabOption(), 8, 1, [1.0])[0]
    base_vocab = CostModel(tiny_hw, plain, CostSettings()).vocab_terms(1, VocabOption(), 8, 1, [1.0])[0]
    assert vocab_terms.micro_batch_s - base_vocab.micro_batch_s == pytest.approx(2 * (0.5 - 2 * 1.0) * k, **EXACT)
    vocab_million = 400 * 2**20 / 16 / 1e6  # the profile's 400 MiB of fp32 states at 16 bytes a parameter
    assert vocab_terms.step_s == pytest.approx((0.25 + 4.0 * vocab_million) * k, **EXACT)
    strategy = Strategy(world_size=4, pp=1, pp_division=[4], global_batch_size=8, num_micro_batches=1,
                        mixed_precision="fp32", layers=[LayerStrategy(tp=1)] * 4)
    after = evaluate_strategy(CostModel(tiny_hw, measured, CostSettings()), strategy)
    expected = 1.5 * k + 4 * float(got.step_s[0]) + vocab_terms.step_s
    assert after.detail.optimizer_s == pytest.approx(expected, **EXACT)  # the rate prices nothing measured


def test_in_flight_micro_batches(tiny, tiny_hw):
    one_f_one_b = CostModel(tiny_hw, tiny, CostSettings(pipeline_schedule=PipelineSchedule.ONE_F_ONE_B))
    gpipe = CostModel(tiny_hw, tiny, CostSettings(pipeline_schedule=PipelineSchedule.GPIPE))
    assert one_f_one_b.in_flight(4, 8) == [4, 3, 2, 1]
    assert one_f_one_b.in_flight(4, 2) == [2, 2, 2, 1]
    assert gpipe.in_flight(4, 8) == [8, 8, 8, 8]  # GPipe keeps every micro-batch's activations
    assert gpipe.in_flight(1, 8) == [1]
    t = one_f_one_b.layer_terms(0, [Candidate(2, 1, 2)], 8, 8)
    assert t.memory_mib(2)[0] == pytest.approx(t.states_mib[0] + 2 * 4 * 10.0)


def test_missing_activation_entry_names_file_and_key(tiny_hw, make_model):
    data = make_model().to_dict()
    data["layer_types"][0]["activation_mib_per_sample"] = {"1": 10.0}
    model = ModelProfile.from_dict(data)
    cost = CostModel(tiny_hw, model, model_source="model.json")
    expected = r"^model.json: layer_types\[0\].activation_mib_per_sample: no entry for tp 2"
    with pytest.raises(SchemaError, match=expected):
        cost.layer_terms(0, [Candidate(1, 2, 2)], 8, 1)


# ------------------------------------------------------------------------------------------------ transitions
def test_redistribution_between_layouts(make_model, tiny_hw):
    cost = CostModel(tiny_hw, make_model())
    cands = [Candidate(1, 1, 4), Candidate(1, 2, 2, True), Candidate(1, 2, 2, False), Candidate(1, 2, 2, True,
                                                                                                 dp_type=ZERO3)]
    r = cost.redistribution(0, cands, 8)
    # What galva_comm's plans move (forward plan, then the reverse plan on the gradient), for the busiest rank.
    # tp 1 -> 2: each rank fetches the other 2 samples of its group forward; backward the split is local.
    gather = 2 * S * H * E / 200e9
    assert r[0, 1] == pytest.approx(gather, **EXACT)
    # tp 2 -> 1: the split is local forward, but backward the tp 2 layer needs the whole gradient of its group's
    # 4 samples on both of its ranks (replicated activation): the same 2 samples move.
    assert r[1, 0] == pytest.approx(gather, **EXACT)
    # consecutive -> strided groups on 4 ranks: ranks 1 and 2 hold none of the samples they need (4 of the 8), both
    # ways; at the bandwidth of the wider side, here the source's (consecutive pairs 200 GB/s, strided 50 GB/s)
    assert r[1, 2] == pytest.approx(2 * 4 * S * H * E / 200e9, **EXACT)
    assert r[2, 1] == pytest.approx(2 * 4 * S * H * E / 50e9, **EXACT)
    assert r[1, 3] == 0.0  # same layout, only the dp type differs
    penalty = cost.switch_penalties(0, cands)
    assert penalty[1, 3] == pytest.approx(1e-9) and penalty[1, 1] == 0.0
    sp_cost = CostModel(tiny_hw, make_model(megatron_sp=True), CostSettings(megatron_sp=True))
    r = sp_cost.redistribution(0, cands, 8)
    # Megatron-SP tp 2 -> 1: the busiest rank fetches 1/8 of the micro-batch forward and 1/8 backward
    assert r[1, 0] == pytest.approx(2 * (2 * S * H * E / 2) / 200e9, **EXACT)


def test_a_boundary_pays_one_call_per_direction_that_moves(make_model, tiny_hw):
    """Each redistribution plan that moves cells is one all_to_all_single in the runtime: a micro-batch pays its
    latency (the all-to-all curve's smallest point plus the busy extra) once per such direction, whatever the
    micro-batch's size; a boundary whose layouts agree pays nothing, and a profile without the curve only the bytes."""
    curve = CollectiveTimes(group_size=2, message_mib=(0.00390625, 4.0), time_ms=(0.75, 2.0))
    extra = CallExtra(group_size=2, collective="all_to_all", ms=0.5)
    hw = tiny_hw.model_copy(update={"all_to_all_time": (curve,), "call_extra": (extra,)})
    cands = [Candidate(1, 1, 4), Candidate(1, 2, 2, True), Candidate(1, 2, 2, False), Candidate(1, 2, 2, True,
                                                                                                 dp_type=ZERO3)]
    call = (0.75 + 0.5) * 1e-3
    for micro_batch in (8, 2):
        bytes_only = CostModel(tiny_hw, make_model()).redistribution(0, cands, micro_batch)
        calls = CostModel(hw, make_model()).redistribution(0, cands, micro_batch) - bytes_only
        # tp 1 -> 2 gathers forward and splits locally backward; tp 2 -> 1 the reverse: one call either way
        assert calls[0, 1] == pytest.approx(call, **EXACT) and calls[1, 0] == pytest.approx(call, **EXACT)
        # consecutive <-> strided pairs move cells both ways: two calls
        assert calls[1, 2] == pytest.approx(2 * call, **EXACT) and calls[2, 1] == pytest.approx(2 * call, **EXACT)
        assert calls[1, 3] == 0.0 and np.all(np.diag(calls) == 0.0)
    # the vocabulary's boundaries (tp 1 embedding and head) into and out of a tp 2 layer: one call each
    into, out = CostModel(hw, make_model()).vocab_boundaries(VocabOption(1), cands[:2], 8)
    into_bytes, out_bytes = CostModel(tiny_hw, make_model()).vocab_boundaries(VocabOption(1), cands[:2], 8)
    assert into[0] == into_bytes[0] == 0.0 and out[0] == out_bytes[0] == 0.0
    assert into[1] - into_bytes[1] == pytest.approx(call, **EXACT)
    assert out[1] - out_bytes[1] == pytest.approx(call, **EXACT)


# ------------------------------------------------------------------------------------------------ vocabulary
def test_vocab_terms_single_stage(tiny, tiny_hw):
    cost = CostModel(tiny_hw, tiny, CostSettings(state_accounting="reference"))
    (v,) = cost.vocab_terms(1, VocabOption(1), 8, 1, [1])
    sync = 2 * 3 / 4 * (400 * 2**20 / 16 * 2) / 100e9
    assert v.micro_batch_s == pytest.approx(0.002 + 0.004, **EXACT)
    assert v.exposed_sync_s == pytest.approx(0.25 * sync, **EXACT)
    assert v.memory_mib == pytest.approx(400 + 2 * 40.0)
    (v,) = cost.vocab_terms(1, VocabOption(2), 8, 1, [1])
    tp = 2 * (2 * 1 / 2 * 4 * S * H * E / 200e9)  # embedding and head all-reduce
    assert v.micro_batch_s == pytest.approx(0.006 + tp, **EXACT)  # compute at 4 samples / vocab tp 2
    assert v.memory_mib == pytest.approx(200 + 4 * 20.0)
    (v,) = cost.vocab_terms(1, VocabOption(2, zero3=True), 8, 1, [1])
    assert v.memory_mib == pytest.approx(200 * (1 + 1 + 6) / 16 + 4 * 20.0)
    (v,) = cost.vocab_terms(1, VocabOption(2, sp=True), 8, 1, [1])
    assert v.micro_batch_s == pytest.approx(0.006, **EXACT)  # no vocab tp collectives
    assert v.memory_mib == pytest.approx(400 + 4 * 20.0)  # states of vocab tp 1, replicated


def test_a_profiled_vocab_form_is_priced_call_by_call_with_its_own_work(tiny, tiny_hw):
    """Where the profile recorded a form's collectives and timed its own work (VocabProfile.forms), each call is
    priced from the hardware's curves at the plan's local batch and the work is added to the pass it was timed in:
    the tp form's calls replace the two all-reduces assumed without them, ZeRO-3's its one gather; each module's
    part goes to the stage that holds it."""
    from galva_schema import CollectiveCall, VocabForm, VocabPart

    def part(f: float, b: float, step: float, *calls: CollectiveCall) -> VocabPart:
        return VocabPart(overhead_ms=(f, b, step), calls=calls)

    per_token = S * H * E  # one sample's hidden state
    reduce = CollectiveCall(op="all_reduce", backward=False, bytes_per_sample=per_token)
    small = CollectiveCall(op="all_reduce", backward=True, bytes_per_sample=4 * S, bytes_fixed=8)
    tp = VocabForm(embedding=part(1.0, 0.5, 0.0, reduce), head=part(2.0, 1.0, 0.0, reduce, small, small))
    gather = CollectiveCall(op="all_gather", backward=False, bytes_per_sample=0.0, bytes_fixed=2**20)
    again = gather.model_copy(update={"backward": True})
    scatter = CollectiveCall(op="reduce_scatter", backward=True, bytes_per_sample=0.0, bytes_fixed=2**20)
    zero3 = VocabForm(
        embedding=part(0.3, 0.4, 0.1, gather, again, scatter), head=part(0.3, 0.4, 0.2, gather, again, scatter)
    )
    forms = {"tp": {2: tp}, "zero3": {2: zero3}}
    profiled = tiny.model_copy(update={"vocab": tiny.vocab.model_copy(update={"forms": forms})})
    plain, cost = CostModel(tiny_hw, tiny), CostModel(tiny_hw, profiled)
    comm = cost.comm

    def priced(local: float) -> tuple[float, float]:
        """(the tp form's four calls, the two all-reduces assumed without them) at ``local`` samples a rank"""
        reduces = 2 * float(comm.allreduce(2, True, local * per_token))
        two = 2 * float(comm.allreduce(2, True, local * per_token))
        return reduces + 2 * float(comm.allreduce(2, True, local * 4 * S + 8)), two

    # one stage of the 4 ranks: vocab tp 2 beside dp 2, 4 samples a rank
    (v,) = cost.vocab_terms(1, VocabOption(2), 8, 1, [1])
    (base,) = plain.vocab_terms(1, VocabOption(2), 8, 1, [1])
    calls, assumed = priced(4)
    assert v.micro_batch_s - base.micro_batch_s == pytest.approx(calls - assumed + 4.5e-3, **EXACT)
    # two stages of 2 ranks, 8 samples a rank: the embedding's part on the first, the head's on the last
    first, last = cost.vocab_terms(2, VocabOption(2), 8, 4, [2, 1])
    first0, last0 = plain.vocab_terms(2, VocabOption(2), 8, 4, [2, 1])
    calls, assumed = priced(8)
    one = assumed / 2
    assert first.micro_batch_s - first0.micro_batch_s == pytest.approx(1.5e-3, **EXACT)  # one call, as assumed
    assert last.micro_batch_s - last0.micro_batch_s == pytest.approx(calls - one - one + 3e-3, **EXACT)
    assert calls - assumed > 0.0  # the head's two small calls
    # ZeRO-3 over the 4 ranks (profiled at 2: the largest degree below): a unit per module, two gathers forward
    (z,) = cost.vocab_terms(1, VocabOption(1, zero3=True), 8, 1, [1])
    (z0,) = plain.vocab_terms(1, VocabOption(1, zero3=True), 8, 1, [1])
    assert z.step_s - z0.step_s == pytest.approx(3e-4, **EXACT)
    assert z.micro_batch_s > 2 * float(comm.all_gather(4, True, 2**20)) + 0.6e-3 + 0.8e-3 + 2 * 0.004 * 3 / 4
    assert z.micro_batch_s > z0.micro_batch_s


def test_vocab_terms_split_over_first_and_last_stage(tiny, tiny_hw):
    cost = CostModel(tiny_hw, tiny)
    first, last = cost.vocab_terms(2, VocabOption(1), 8, 4, [2, 1])
    assert first.micro_batch_s == pytest.approx(0.5 * 0.004 * 3, **EXACT)
    assert first.memory_mib == pytest.approx(400 * (2 + 2 + 12) / 16 + 2 * 4 * 40.0)  # 2 in flight
    assert last.memory_mib == pytest.approx(400 + 1 * 4 * 40.0)
    options = cost.vocab_options(1, 8, allow_sp=True, allow_zero3=True)
    assert VocabOption(4, True, True) in options and VocabOption(8) not in options


# ------------------------------------------------------------------------------------------------ pipeline
def test_pipeline_time_bubble_and_sync_tail():
    assert pipeline_time([1.0, 2.0, 1.0], [0.5, 3.5, 0.0], 4).total == pytest.approx(4 + 3 * 2 + 2.5)
    assert pipeline_time([2.0], [0.5], 3).total == pytest.approx(6.5)
    assert pipeline_time([2.0, 2.0], [0.0, 1.0], 1).total == pytest.approx(4.0)  # tail hidden by stage 0's backward


# ------------------------------------------------------------------------------------------------ reference §4.6
def _reference_hardware(hw_1x8: HardwareProfile) -> HardwareProfile:
    """§4.6's coefficients as bandwidths: the reference's coe is ms per MiB, i.e. 1/coe MiB/ms = 1.048576/coe GB/s."""
    coe = {(8, True): 0.0064850, (4, False): 0.0064179, (4, True): 0.0062846, (2, False): 0.0066075,
           (2, True): 0.0072382}
    allreduce = [e.model_copy(update={"bus_bandwidth_gb_per_s": 1.048576 / coe[(e.group_size, e.consecutive)]})
                 for e in hw_1x8.allreduce]
    return hw_1x8.model_copy(update={"allreduce": tuple(allreduce), "allreduce_time": (), "all_to_all_time": ()})


@pytest.mark.parametrize(
    ("label", "cand", "with_comm", "no_comm"),
    [
        ("1-1-8", Candidate(1, 1, 8, dp_type=ZERO2), 0.0149191, 0.0143683),
        ("1-2*-4", Candidate(1, 2, 4, True, ZERO2), 0.0155284, 0.0152948),
        ("1-2*-4-c", Candidate(1, 2, 4, True, ZERO2, checkpoint=True), 0.0207811, 0.0205474),
        ("1-8-1", Candidate(1, 8, 1, dp_type=ZERO2), 0.0201788, 0.0201788),
        ("1-1-8f", Candidate(1, 1, 8, dp_type=ZERO3), 0.0171130, None),
    ],
)
def test_layer_time_agrees_with_reference_where_no_defect_applies(hw_1x8, llama7b, label, cand, with_comm, no_comm):
    """§4.6 golden per-layer times at a global micro-batch of 8 (s): equal once bandwidth units are converted
    exactly. The reference's 'with comm' time = our micro-batch time + the exposed gradient sync."""
    settings = CostSettings(default_dp_type=ZERO2, state_accounting="reference")  # the reference reduces bf16
    cost = CostModel(_reference_hardware(hw_1x8), llama7b, settings)
    t = cost.layer_terms(0, [cand], 8, 4)
    # the reference's recomputation repeats both tp all-reduces, galva-hp's the first only (§8.19)
    repeated = t.tp_comm_s[0] / 5 if cand.checkpoint and cand.tp > 1 else 0.0
    assert t.micro_batch_s[0] + repeated + t.exposed_sync_s[0] == pytest.approx(with_comm, abs=6e-8), label
    if no_comm is not None:
        assert t.micro_batch_s[0] + repeated == pytest.approx(no_comm, abs=6e-8), label


@pytest.mark.parametrize(
    ("cand", "ref_states", "ref_activation", "shard"),
    [
        (Candidate(1, 1, 8, dp_type=ZERO2), 1070.179, 301.282, 8),
        (Candidate(1, 1, 8, dp_type=ZERO3), 733.042, 301.282, 8),
        (Candidate(1, 2, 4, True, ZERO2), 680.074, 364.313, 4),
        (Candidate(1, 2, 4, True, ZERO2, checkpoint=True), 680.074, 32.0, 4),
        (Candidate(1, 8, 1, dp_type=ZERO2), 386.625, 748.5, 1),
    ],
)
def test_layer_memory_agrees_with_reference_up_to_its_0003_padding(hw_1x8, llama7b, cand, ref_states,
                                                                   ref_activation, shard):
    """§4.6 memory at B = 32, 4 micro-batches, stage 0: activations are equal; model states equal the reference's
    ratios once its ``+0.003`` on ``1/d`` is removed (a deliberate divergence)."""
    cost = CostModel(hw_1x8, llama7b, CostSettings(default_dp_type=ZERO2, state_accounting="reference"))
    t = cost.layer_terms(0, [cand], 8, 4)
    assert t.activation_mib[0] * cost.in_flight(1, 4)[0] == pytest.approx(ref_activation, abs=1e-3)
    full = 4 * 773.2509765625 / cand.tp
    if shard == 1:
        assert t.states_mib[0] == pytest.approx(ref_states, abs=1e-3)
        return
    # reference ratio with e = 1/d + 0.003 (c > 1, async): zero2 6/8 e + 2/8, zero3 7/8 e + 1/8
    ratio = (6 / 8, 2 / 8) if cand.dp_type is ZERO2 else (7 / 8, 1 / 8)
    assert full * (ratio[0] * (1 / shard + 0.003) + ratio[1]) == pytest.approx(ref_states, abs=1e-3)
    assert t.states_mib[0] == pytest.approx(full * (ratio[0] / shard + ratio[1]), **EXACT)


def test_tables_are_vectorised_consistently(hw_1x8, llama7b):
    """A table over many candidates equals the tables of each candidate alone."""
    from galva_search.space import SpaceOptions, generate_space

    cost = CostModel(hw_1x8, llama7b, CostSettings(default_dp_type=ZERO2))
    cands = [c for c in generate_space(8, SpaceOptions(sp_space="tp+sp")) if c.pp == 1]
    together = cost.layer_terms(0, cands, 16, 2)
    for i, c in enumerate(cands):
        alone = cost.layer_terms(0, [c], 16, 2)
        for name in ("micro_batch_s", "exposed_sync_s", "states_mib", "activation_mib", "p2p_s"):
            assert getattr(together, name)[i] == pytest.approx(getattr(alone, name)[0], **EXACT), (c, name)
    assert np.all(together.micro_batch_s > 0)



# ------------------------------------------------------------------------------------------------ galva-hp states
@pytest.mark.parametrize(
    ("dp_type", "c", "per_parameter"),
    [
        # bf16 (2, 4, 12) over d = 2 (issue #9: galva-profile check measured these on tiny-llama and tiny-gpt2)
        (DDP, 1, 2 + 4 + 12),  # bf16 weight, fp32 master gradient, fp32 master, Adam m and v
        (DDP, 4, 2 + 4 + 12),
        (ZERO2, 1, 2 + 12 / 2),  # the fp32 gradient shard (4/2) appears as the gathered bf16 copy (2) goes
        (ZERO2, 4, 2 + 4 + 12 / 2),  # FSDP2 accumulates the unsharded gradient in its fp32 reduce dtype
        (ZERO3, 1, 4 / 2 + 12 / 2),  # at rest: the master shard (in o) and the gradient shard
        (ZERO3, 4, 4 + 12 / 2),
    ],
)
def test_galva_hp_bf16_state_bytes_by_dp_type(tiny, tiny_hw, dp_type, c, per_parameter):
    t, cost = terms(tiny, tiny_hw, Candidate(1, 2, 2, dp_type=dp_type), c=c, state_accounting="galva-hp")
    assert cost.settings.state_bytes == (2, 4, 12)
    parameters = 64 / 4 / 2  # Mi parameters per rank at tp 2
    assert t.states_mib[0] == pytest.approx(parameters * per_parameter, **EXACT)


@pytest.mark.parametrize(
    ("dp_type", "c", "per_parameter"),
    [
        (DDP, 1, 16),
        (ZERO2, 1, 4 + 4 / 4 + 8 / 4),
        (ZERO2, 2, 4 + 4 / 4 + 4 + 8 / 4),  # the fp32 shard beside the gathered copy and the accumulated gradient
        (ZERO3, 1, 16 / 4),
        (ZERO3, 2, 4 / 4 + 4 + 8 / 4),
    ],
)
def test_galva_hp_fp32_state_bytes_equal_the_reference_formulas(make_model, tiny_hw, dp_type, c, per_parameter):
    fp32 = make_model(precision="fp32")
    cand = Candidate(1, 1, 4, dp_type=dp_type)
    for accounting in ("galva-hp", "reference"):
        t, _ = terms(fp32, tiny_hw, cand, c=c, precision=Precision.FP32, state_accounting=accounting)
        assert t.states_mib[0] == pytest.approx(64 / 4 * per_parameter, **EXACT), accounting


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
@pytest.mark.parametrize("dp_type", [ZERO2, ZERO3])
def test_galva_hp_zero_over_one_rank_is_ddp(make_model, tiny_hw, precision, dp_type):
    """galva-hp wraps a one-rank sharding group as a ddp unit: no shard beside the gathered copy."""
    model = make_model(precision=precision.value)
    for c in (1, 4):
        t, cost = terms(model, tiny_hw, Candidate(1, 4, 1, dp_type=dp_type), c=c, precision=precision,
                        state_accounting="galva-hp")
        assert t.states_mib[0] == pytest.approx(64 / 4 / 4 * sum(cost.settings.state_bytes), **EXACT)


def test_galva_hp_vocab_states_are_the_profiles_bytes(tiny, tiny_hw):
    """The profiler writes a bf16 profile's vocabulary states at galva-hp's 18 bytes per parameter: the cost model
    reads them back unchanged under ddp, shards them as a layer under ZeRO-3, and syncs its fp32 gradients, 4 bytes
    per parameter."""
    from galva_search.cost_model import state_bytes_per_parameter

    assert state_bytes_per_parameter(Precision.BF16) == 18
    assert state_bytes_per_parameter(Precision.FP32) == 16
    assert state_bytes_per_parameter(Precision.BF16, "reference") == 16
    cost = CostModel(tiny_hw, tiny, CostSettings(state_accounting="galva-hp"))
    (v,) = cost.vocab_terms(1, VocabOption(1), 8, 1, [1])
    assert v.memory_mib == pytest.approx(400 + 2 * 40.0)
    sync = 2 * 3 / 4 * (400 * 2**20 / 18 * 4) / 100e9
    assert v.exposed_sync_s == pytest.approx(0.25 * sync, **EXACT)
    (v,) = cost.vocab_terms(1, VocabOption(2, zero3=True), 8, 1, [1])
    assert v.memory_mib == pytest.approx(200 * (4 / 2 + 12 / 2) / 18 + 4 * 20.0)
    # an fp32 plan on the bf16 profile: the same parameters at 16 bytes
    fp32 = CostModel(tiny_hw, tiny, CostSettings(precision=Precision.FP32, state_accounting="galva-hp"))
    (v,) = fp32.vocab_terms(1, VocabOption(1), 8, 1, [1])
    assert v.states_mib == pytest.approx(400 / 18 * 16)


def test_unknown_state_accounting_is_refused():
    with pytest.raises(ValueError, match="state accounting 'galvatron' is not one of reference, galva-hp"):
        CostSettings(state_accounting="galvatron")


# ------------------------------------------------------------------------------------------------ experts
def _moe(make_model):
    """The tiny layer with routed experts: 48 of its 64 MiB in 4 experts (top-2), 1 MiB router."""
    from galva_schema import BatchTime, ExpertProfile

    model = make_model()
    experts = ExpertProfile(
        num_experts=4, top_k=2, expert_ffn=256, expert_parameter_mib=48.0, block_parameter_mib=1.0,
        expert_time=BatchTime(slope_ms_per_sample=0.001, intercept_ms=0.01), router_ms_per_token=0.0,
        imbalance={1: 1.0, 2: 1.1, 4: 1.25}, activation_mib_per_row=0.001, dispatch_activation_mib_per_row=0.0001,
    )
    layer = model.layer_types[0].model_copy(update={"experts": experts})
    return model.model_copy(update={"layer_types": (layer,)})


def test_expert_layout_terms(make_model, tiny_hw):
    """ep / etp / expert dp type: states, compute, dispatch all-to-alls and activations (docs/cost-model.md §3.5)."""
    model = _moe(make_model)
    cost = CostModel(tiny_hw, model, CostSettings())
    plain, ep4, tp2 = Candidate(1, 1, 4), Candidate(1, 1, 4, ep=4), Candidate(1, 2, 2)
    t = cost.layer_terms(0, [plain, ep4, tp2], 8, 1)
    # states (ddp: all bytes): rest 15 MiB + router 1 MiB, experts 48 / ep; tp splits the rest, not the router
    assert t.states_mib[1] / t.states_mib[0] == pytest.approx((16 + 12) / 64, **EXACT)
    assert t.states_mib[2] / t.states_mib[0] == pytest.approx((15 / 2 + 1 + 48) / 64, **EXACT)
    # compute: 2048 rows on the rank (2 samples x 512 tokens x top-2), 25% more on the busiest, 1 expert call not 4
    scale = CostSettings().factors.compute * tiny_hw.compute_slowdown
    assert t.forward_s[1] - t.forward_s[0] == pytest.approx((0.001 * 2048 * 0.25 - 0.01 * 3) * 1e-3 * scale, **EXACT)
    # 2 all-to-alls forward, 2 backward over ep 4 of the busiest rank's rows x hidden; 3 of its rows (counts, weights)
    comm = Collectives(tiny_hw)
    rows = 2 * S * 2 * 1.25 * E  # bytes of one element per routed row of the busiest rank
    a2a = 4 * float(comm.all_to_all(4, True, rows * H)) + 3 * float(comm.all_to_all(4, True, rows))
    assert t.expert_comm_s[1] == pytest.approx(a2a * CostSettings().factors.tp_comm, **EXACT)
    assert t.expert_comm_s[0] == 0 and t.expert_comm_s[1] <= t.tp_comm_s[1]
    # activations: 1024 rows per sample, 25% more kept by the busiest rank, plus dispatch's bytes per row
    extra = 1024 * (0.25 * 0.001 + 1.25 * 0.0001) * 2 * CostSettings().factors.activations
    assert t.activation_mib[1] - t.activation_mib[0] == pytest.approx(extra, **EXACT)


def test_expert_activations_from_the_summed_routing(make_model, tiny_hw):
    """With per-forward figures of the rows summed over the layers, the busiest rank keeps the expected largest of
    its stage's expert-dp groups' figures, the excess scaled to the tokens its ep group routes (docs §3.5)."""
    model = _moe(make_model)
    experts = model.layer_types[0].experts.model_copy(
        update={"memory_imbalance": {2: [1.0, 1.04, 1.08, 1.12], 4: [1.1, 1.2, 1.2, 1.3]}, "routed_tokens": 1024}
    )
    layer = model.layer_types[0].model_copy(update={"experts": experts})
    cost = CostModel(tiny_hw, model.model_copy(update={"layer_types": (layer,)}), CostSettings())
    plain, ep4, ep2 = Candidate(1, 1, 4), Candidate(1, 1, 4, ep=4), Candidate(1, 1, 4, ep=2)
    t = cost.layer_terms(0, [plain, ep4, ep2], 8, 1)
    f = CostSettings().factors.activations
    # ep 4, one group (expert dp 1): mean excess 0.2 over 4 x 2 x 512 tokens routed (1024 profiled): x sqrt(1/4)
    extra4 = 1024 * 2 * (0.1 * 0.0011 + 0.0001)
    assert t.activation_mib[1] - t.activation_mib[0] == pytest.approx(extra4 * f, **EXACT)
    # ep 2, two groups (expert dp 2): the larger of 2 of the 4 figures is on average 1.08; 2048 tokens: x sqrt(1/2)
    largest = (1.04 * 1 + 1.08 * 2 + 1.12 * 3) / 6
    extra2 = 1024 * 2 * ((largest - 1) * math.sqrt(0.5) * 0.0011 + 0.0001)
    assert t.activation_mib[2] - t.activation_mib[0] == pytest.approx(extra2 * f, **EXACT)


def test_expert_zero3_replicas_gather_and_shard(make_model, tiny_hw):
    """ZeRO-3 experts over 2 replicas (ep 2 of 4 ranks) under a ddp layer: their states are sharded, their
    gathered copy is a transient and its all-gather is paid every micro-batch."""
    model = _moe(make_model)
    cost = CostModel(tiny_hw, model, CostSettings())
    ddp, zero3 = Candidate(1, 1, 4, ep=2), Candidate(1, 1, 4, ep=2, expert_dp_type=ZERO3)
    t = cost.layer_terms(0, [ddp, zero3], 8, 1)
    assert t.states_mib[1] < t.states_mib[0] and t.zero3_comm_s[0] == 0 < t.zero3_comm_s[1]
    assert t.transient_mib[1] == pytest.approx(2 * 24 / 4 * E, **EXACT)  # 24 MiB fp32 of experts, bf16 copy, x2


@pytest.mark.parametrize("megatron_sp", [False, True])
def test_costs_of_a_list_inside_one_already_priced_are_its_rows(make_model, tiny_hw, megatron_sp):
    """A search prices one candidate list per micro-batch size (those whose dp divides it); a list inside one already
    priced takes its rows from it: every term, re-sharding and tie-breaker equal, bit for bit, to pricing it anew."""
    from dataclasses import fields

    from galva_search.space import SpaceOptions, generate_space, with_expert_layouts

    model = _moe(lambda: make_model(megatron_sp=megatron_sp))  # tp, Megatron-SP, ep, etp: every collective group
    settings = CostSettings(megatron_sp=megatron_sp)
    pool = with_expert_layouts(generate_space(4, SpaceOptions(sp_space="tp+sp")), [(4, 256)], 4)
    pool = [c for c in pool if c.pp == 1]
    inside = [c for c in pool if 2 % c.dp == 0]
    assert 0 < len(inside) < len(pool) and any(c.etp > 1 and c.tp > 1 for c in inside)
    reused, fresh = CostModel(tiny_hw, model, settings), CostModel(tiny_hw, model, settings)
    reused.layer_terms(0, pool, 4, 2)
    got, expected = reused.layer_terms(0, inside, 2, 2), fresh.layer_terms(0, inside, 2, 2)
    assert len(reused._layers._static_cache) == 2 and len(fresh._layers._static_cache) == 1
    for f in fields(got):
        assert np.array_equal(getattr(got, f.name), getattr(expected, f.name)), f.name
    assert np.array_equal(reused.redistribution(0, inside, 2), fresh.redistribution(0, inside, 2))
    assert np.array_equal(reused.switch_penalties(0, inside), fresh.switch_penalties(0, inside))


def test_ddp_sync_is_priced_per_bucket_as_galva_hp_forms_them(make_model, tiny_hw):
    """Layers of 1 MiB of gradients share one all-reduce (galva_comm.buckets, 25 MiB cap): the score prices one
    collective of their summed bytes against their summed backward, the vocabulary keeps its own; cap 0 (or layers of
    half the cap and more) prices one per layer as before. Each layer is priced its share of its chunk's buckets (the
    stage DP's rows and the score alike); 5 layers of which 2 fit a bucket: buckets of 2, 2 and 1."""
    from galva_schema import CollectiveTimes, LayerStrategy, Strategy
    from galva_search.evaluation import evaluate_strategy
    from galva_search.sync_buckets import bucket_share_s

    plain = make_model()
    small = plain.model_copy(update={"layer_types": (plain.layer_types[0].model_copy(update={"parameter_mib": 0.5}),)})
    curve = CollectiveTimes(group_size=4, message_mib=(0.00390625, 4.0), time_ms=(1.0, 2.0))  # 1 ms latency
    hw = tiny_hw.model_copy(update={"allreduce_time": (curve,)})
    strategy = Strategy(world_size=4, pp=1, pp_division=[4], global_batch_size=8, num_micro_batches=1,
                        mixed_precision="bf16", layers=[LayerStrategy(tp=1)] * 4)
    bucketed, per_layer = CostModel(hw, small, CostSettings()), CostModel(hw, small, CostSettings(bucket_cap_bytes=0))
    terms = bucketed.layer_terms(0, [Candidate(1, 1, 4)], 2, 1)
    g, grad_bytes = float(terms.backward_s[0]), float(terms.bucket_bytes[0])
    assert grad_bytes == 0.5 * 2**20 and tuple(terms.bucket_group[0]) == (4, 1)  # fp32 gradients, whole stage
    comm = bucketed.comm
    vocab = float(bucketed.vocab_terms(1, VocabOption(), 8, 1, [1])[0].exposed_sync_s)
    one = float(comm.overlapped(4 * g, comm.allreduce(4, True, 4 * grad_bytes))) - 4 * g
    alone = float(comm.overlapped(g, comm.allreduce(4, True, grad_bytes))) - g
    assert one < 4 * alone  # three latencies fewer
    got = evaluate_strategy(bucketed, strategy).detail
    assert got.stage_exposed_s[0] == pytest.approx(vocab + one, **EXACT)
    assert evaluate_strategy(per_layer, strategy).detail.stage_exposed_s[0] == pytest.approx(vocab + 4 * alone)
    assert bucket_share_s(comm, terms, 4, 25 * 2**20)[0] == pytest.approx(one / 4, **EXACT)
    assert bucket_share_s(comm, terms, 4, 0)[0] == pytest.approx(alone, **EXACT)
    two = float(comm.overlapped(2 * g, comm.allreduce(4, True, 2 * grad_bytes))) - 2 * g
    assert bucket_share_s(comm, terms, 5, 2.5 * grad_bytes)[0] == pytest.approx((2 * two + alone) / 5, **EXACT)
    # the test model's own 64 MiB layers are over half the cap: one all-reduce each, unchanged
    big = CostModel(hw, plain, CostSettings())
    assert evaluate_strategy(big, strategy).iteration_time_s == pytest.approx(
        evaluate_strategy(CostModel(hw, plain, CostSettings(bucket_cap_bytes=0)), strategy).iteration_time_s, **EXACT)


def test_the_step_pays_the_loss_and_clip_all_reduces_where_it_is_measured(make_model, tiny_hw):
    """galva-hp all-reduces a few numbers over the world twice every step, the loss's totals right after the
    gradients' reduction and the clip's squared norm after the norms: priced at the all-reduce curve's smallest size,
    the busy extra on the clip's only, with the measured step (optimizer_call_ms); nothing without a curve or without
    the measured step."""
    stepped = make_model().model_copy(update={"optimizer_call_ms": 0.5})
    curve = CollectiveTimes(group_size=4, message_mib=(16 / 2**20, 0.00390625, 4.0), time_ms=(1.25, 1.5, 2.0))
    extra = CallExtra(group_size=4, collective="all_reduce", ms=0.75)
    hw = tiny_hw.model_copy(update={"allreduce_time": (curve,), "call_extra": (extra,)})
    call = 0.5e-3 * tiny_hw.compute_slowdown
    assert CostModel(hw, stepped, CostSettings()).optimizer_call_s() == pytest.approx(
        call + 1.25e-3 + (1.25e-3 + 0.75e-3), **EXACT)
    assert CostModel(tiny_hw, stepped, CostSettings()).optimizer_call_s() == pytest.approx(call, **EXACT)
    assert CostModel(hw, make_model(), CostSettings()).optimizer_call_s() == 0.0


def test_zero2_gathers_its_parameters_before_every_micro_batch(make_model, tiny_hw):
    """galva-hp's ZeRO-2 unit all-gathers before each micro-batch's forward (counted: 1, 2 and 4 a layer at 1, 2 and
    4 micro-batches) and reduce-scatters once: the c - 1 gathers beyond the sync's one are priced, by the score and
    by the stage DP alike; ddp and ZeRO-3 (whose gathers are in its micro-batch term) are unchanged."""
    from galva_schema import LayerStrategy, Strategy
    from galva_search.evaluation import evaluate_strategy

    cost = CostModel(tiny_hw, make_model(), CostSettings())
    cands = [Candidate(1, 1, 4, dp_type=ZERO2), Candidate(1, 1, 4), Candidate(1, 1, 4, dp_type=ZERO3)]
    t = cost.layer_terms(0, cands, 4, 2)
    gather = float(cost.comm.all_gather(4, True, 64 * 2**20 / 4 * 2))  # the bf16 compute copy
    assert t.regather_s == pytest.approx([gather, 0.0, 0.0], **EXACT)

    def plan(c: int, dp_type: str) -> Strategy:
        return Strategy(world_size=4, pp=1, pp_division=[4], global_batch_size=8, num_micro_batches=c,
                        mixed_precision="bf16", layers=[LayerStrategy(tp=1, dp_type=dp_type)] * 4,
                        default_dp_type=dp_type)

    zero2 = CostModel(tiny_hw, make_model(), CostSettings(default_dp_type=ZERO2))  # the plans' vocabulary dp type
    vocab = zero2.vocab_terms(1, VocabOption(), 4, 2, [1])[0].regather_s
    assert vocab > 0.0 and cost.vocab_terms(1, VocabOption(), 4, 2, [1])[0].regather_s == 0.0
    got = evaluate_strategy(cost, plan(2, "zero2")).detail  # a micro-batch of 4 samples, one a rank
    assert got.stage_parts_s["dp"][0] == pytest.approx((4 * gather + vocab) / 2, **EXACT)
    assert evaluate_strategy(cost, plan(1, "zero2")).detail.stage_parts_s["dp"][0] == 0.0
