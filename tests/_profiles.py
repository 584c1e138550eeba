"""Hand-written profiles for cross-package tests: a 4-GPU node, and a 4-layer slice of a LLaMA-7B-shaped model.

The layer numbers are the reference system's shipped LLaMA-7B profile (spec §4.6): with them, memory budgets steer
the search to genuinely different plans. A plan only depends on the layer count and on divisibility, so the plans
searched for this profile are then trained on the tiny 4-layer Llama of galva_hp.testing.models.
"""

from __future__ import annotations

from galva_schema import (
    AllreduceBandwidth,
    ClusterSpec,
    HardwareProfile,
    LayerTypeProfile,
    ModelProfile,
    P2PBandwidth,
    StaticTime,
    VocabMemory,
    VocabProfile,
)

WORLD, LAYERS, HIDDEN, SEQ = 4, 4, 4096, 2048


def hardware() -> HardwareProfile:
    return HardwareProfile(
        cluster=ClusterSpec(num_nodes=1, gpus_per_node=WORLD, device_name="cpu"),
        backend="gloo",
        allreduce=(
            AllreduceBandwidth(group_size=4, consecutive=True, bus_bandwidth_gb_per_s=158.0),
            AllreduceBandwidth(group_size=2, consecutive=True, bus_bandwidth_gb_per_s=149.5),
            AllreduceBandwidth(group_size=2, consecutive=False, bus_bandwidth_gb_per_s=148.8),
        ),
        p2p=(P2PBandwidth(pp=2, bandwidth_gb_per_s=162.1), P2PBandwidth(pp=4, bandwidth_gb_per_s=140.2)),
        overlap_slowdown=1.1256,
    )


def llama_slice_profile() -> ModelProfile:
    first = VocabMemory(
        model_states_mib={1: 2157.0, 2: 1100.0, 4: 560.0}, activation_mib_per_sample={1: 46.6, 2: 25.0, 4: 14.0}
    )
    last = VocabMemory(
        model_states_mib={1: 2157.0, 2: 1100.0, 4: 560.0}, activation_mib_per_sample={1: 500.0, 2: 260.0, 4: 140.0}
    )
    whole = VocabMemory(
        model_states_mib={1: 4258.0, 2: 2200.0, 4: 1150.0}, activation_mib_per_sample={1: 572.5, 2: 300.0, 4: 160.0}
    )
    return ModelProfile(
        model_name="llama-7b-slice",
        precision="bf16",
        layer_types=(
            LayerTypeProfile(
                name="decoder",
                num_layers=LAYERS,
                hidden_size=HIDDEN,
                seq_length=SEQ,
                forward_time=StaticTime(ms_per_sample=4.79),
                parameter_mib=773.25,
                activation_mib_per_sample={1: 301.28, 2: 182.16, 4: 123.09},
                checkpoint_activation_mib_per_sample=16.0,
            ),
        ),
        vocab=VocabProfile(
            vocab_size=32000,
            forward_time=StaticTime(ms_per_sample=3.8),
            memory_pp_off=whole,
            memory_pp_first=first,
            memory_pp_last=last,
        ),
    )
