"""Context parallelism in the search: candidates, the ring's cost terms (docs/cost-model.md §3.4) and the LLaMA-7B
long-context example, where cp must enter and win."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from galva_schema import AttentionCoreProfile, HardwareProfile, ModelProfile, Precision, SequenceTime
from galva_search.cost_model import CostModel, CostSettings
from galva_search.options import SearchOptions
from galva_search.ring_costs import step_shares
from galva_search.search import search
from galva_search.space import Candidate, SpaceOptions, generate_space

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "llama-7b-64gpu-long-context"


def test_the_space_has_cp_only_when_asked_and_its_dp_is_what_is_left():
    assert {c.cp for c in generate_space(8)} == {1}
    space = generate_space(8, SpaceOptions(max_cp=4, sp_space="tp+sp"))
    assert {c.cp for c in space} == {1, 2, 4}
    assert all(c.pp * c.tp * c.cp * c.dp == 8 and (c.cp == 1 or c.consecutive) for c in space)
    assert any(c.cp == 2 and c.ulysses and c.tp == 2 for c in space)
    with pytest.raises(ValueError, match="max_cp: 3 is not a power of two"):
        SpaceOptions(max_cp=3)


def _with_core(model: ModelProfile, core_ms: float, kv_bytes: int) -> ModelProfile:
    layer = model.layer_types[0]
    s = layer.seq_length
    core = AttentionCoreProfile(forward_time=SequenceTime(coefficients=(core_ms / s**2, 0.0, 0.0)),
                                kv_bytes_per_token=kv_bytes)  # fmt: skip
    return model.model_copy(update={"layer_types": (layer.model_copy(update={"attention_core": core}),)})


@pytest.mark.parametrize(("cp", "causal", "window"), [(2, True, None), (4, True, 5), (4, True, 13), (2, False, 7)])
def test_ring_step_shares_count_the_pairs_each_rank_computes_at_each_step(cp, causal, window):
    """The closed-form pair counts against every pair of a 48-token sequence placed as the ring places it."""
    seq = 48
    size = seq // (2 * cp)
    owner = np.empty(seq, dtype=int)
    for rank in range(cp):
        for chunk in (rank, 2 * cp - 1 - rank):
            owner[chunk * size : (chunk + 1) * size] = rank
    q, k = np.meshgrid(np.arange(seq), np.arange(seq), indexing="ij")
    attends = (q >= k) if causal else np.ones_like(q, dtype=bool)
    if window is not None:
        attends &= np.abs(q - k) < window
    whole = seq * (seq + 1) / 2 if causal else seq * seq
    expected = np.zeros((cp, cp))
    for rank in range(cp):
        for step in range(cp):
            mine, theirs = owner[q] == rank, owner[k] == (rank - step) % cp
            expected[rank, step] = (attends & mine & theirs).sum() / whole
    assert step_shares(seq, cp, causal, window) == pytest.approx(expected, abs=1e-12)


def test_a_sliding_window_exposes_the_ring_steps_outside_it(tiny, tiny_hw):
    """tiny: 512 tokens. A 32-token window under cp 4: a rank's blocks from the far chunks compute nothing while
    their transfer travels, so the ring exposes more than the same layer attending over the whole sequence;
    a window as long as the sequence prices exactly as none, and a share of windowed layers mixes the two."""
    ring = Candidate(1, 1, 1, cp=4)
    settings = CostSettings(backward_coefficient=2.0)
    whole = _with_core(tiny, 1.0, 1024)
    core = whole.layer_types[0].attention_core
    assert core is not None
    n = whole.layer_types[0].num_layers

    def priced(window, layers):
        update = {"window": window, "window_layers": layers}
        layer = whole.layer_types[0].model_copy(update={"attention_core": core.model_copy(update=update)})
        model = whole.model_copy(update={"layer_types": (layer,)})
        return CostModel(tiny_hw, model, settings).layer_terms(0, [ring], 8, 1).ring_s[0]

    none = priced(None, 0)
    assert priced(512, n) == none  # the window covers the sequence: nothing changes
    windowed = priced(32, n)
    assert windowed > none
    assert priced(32, 0) == none
    if n > 1:
        assert none < priced(32, 1) < windowed


def test_cp_splits_compute_and_activations_and_prices_the_ring(tiny, tiny_hw):
    """tiny: 512 tokens, 2 ms per sample, p2p 25 GB/s. 8 samples over dp 2: 4 per rank. cp 2 halves the compute
    and every activation; its one ring step hides the transfer behind a large core, exposes it behind a small one."""
    plain, ring = Candidate(1, 1, 4), Candidate(1, 1, 2, cp=2)
    settings = CostSettings(backward_coefficient=2.0)
    big = CostModel(tiny_hw, _with_core(tiny, 1.0, 1024), settings)  # one step: 4 x 1 ms / 4 = 1 ms of compute
    t = big.layer_terms(0, [plain, ring], 8, 1)
    assert t.forward_s[1] == pytest.approx(t.forward_s[0])  # 8 / 2 / 2 = 8 / 4 samples-equivalent per rank
    layer = tiny.layer_types[0]
    ring_output = layer.seq_length * layer.hidden_size * 2 / 2**20  # galva-hp's ring keeps one more [S, H] (bf16)
    per_call = layer.activation_mib_per_call
    assert t.activation_mib[0] == pytest.approx(2 * layer.activation_mib_per_sample[1] + per_call)
    # 4 samples at half the tokens
    assert t.activation_mib[1] == pytest.approx(
        4 * (layer.activation_mib_per_sample[1] + ring_output) / 2 + per_call / 2
    )
    block = 4 * 256 * 1024  # 4 samples x 256 tokens x 1 KiB: 1 MiB = 42 us at 25 GB/s, under 1 ms of compute
    transfer = block / 25e9
    # hidden but for the overlap's slowdown (sigma 1.25) of the shorter one: forward kv, backward kv + gradients
    assert t.ring_s[0] == 0.0 and t.ring_s[1] == pytest.approx(0.25 * (transfer + 2 * transfer))
    assert t.transient_mib[1] - t.transient_mib[0] == pytest.approx(3 * block / 2**20)
    small = CostModel(tiny_hw, _with_core(tiny, 1e-4, 1024), settings)  # 0.1 us per step: transfer exposed
    exposed = small.layer_terms(0, [ring], 8, 1).ring_s[0]
    assert exposed == pytest.approx(transfer + 2 * transfer, rel=0.05)  # forward: kv; backward: kv + gradients
    assert small.layer_terms(0, [ring], 8, 1).micro_batch_s[0] - t.micro_batch_s[1] == pytest.approx(
        exposed - t.ring_s[1]
    )


@pytest.mark.parametrize("seq", ["128k"])  # the README's 32k figures: the same call with "32k"
def test_long_context_llama_7b_on_64_gpus_chooses_cp(seq):
    hardware = HardwareProfile.load(EXAMPLE / "hardware.json")
    model = ModelProfile.load(EXAMPLE / f"model-{seq}.json")
    cost = CostModel(hardware, model, CostSettings(precision=Precision.BF16))
    found = {}
    for max_cp in (1, 8):
        space = SpaceOptions(sp_space="tp+sp", max_cp=max_cp)
        found[max_cp] = search(cost, SearchOptions(memory_budget_mib=80e9 / 2**20, batch_sizes=(16,), space=space))
    without, with_cp = found[1], found[8]
    assert all(c.cp == 1 for c in without.candidates)
    assert any(c.cp > 1 for c in with_cp.candidates) and with_cp.strategy.vocab.cp > 1
    gain = with_cp.summary.throughput_samples_per_s / without.summary.throughput_samples_per_s
    assert gain > 2.0, gain
