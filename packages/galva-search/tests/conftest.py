"""Shared fixtures: the small galva-format profiles under tests/data/ and a tiny hand-computable cluster/model."""

from __future__ import annotations

from pathlib import Path

import pytest

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

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def hw_1x8() -> HardwareProfile:
    return HardwareProfile.load(DATA / "hw_1x8.json")


@pytest.fixture(scope="session")
def llama7b() -> ModelProfile:
    return ModelProfile.load(DATA / "llama7b_model.json")


def tiny_hardware(world: int = 4, *, overlap: float = 1.25) -> HardwareProfile:
    """Round numbers: consecutive groups 100 GB/s (2: 200 GB/s), strided 50 GB/s, p2p 25 GB/s."""
    allreduce = []
    n = 2
    while n <= world:
        allreduce.append(AllreduceBandwidth(group_size=n, consecutive=True, bus_bandwidth_gb_per_s=200.0 if n == 2
                                            else 100.0))
        if n < world:
            allreduce.append(AllreduceBandwidth(group_size=n, consecutive=False, bus_bandwidth_gb_per_s=50.0))
        n *= 2
    p2p = []
    p = 2
    while p <= world:
        p2p.append(P2PBandwidth(pp=p, bandwidth_gb_per_s=25.0))
        p *= 2
    return HardwareProfile(
        cluster=ClusterSpec(num_nodes=1, gpus_per_node=world, device_memory_mib=16384.0),
        allreduce=allreduce,
        p2p=p2p,
        overlap_slowdown=overlap,
    )


def tiny_model(num_layers: int = 4, *, megatron_sp: bool = False, precision: str = "bf16") -> ModelProfile:
    """H 1024, S 512, 64 MiB of fp32 parameters per layer, 2 ms forward per sample."""
    vocab_mem = VocabMemory(model_states_mib={1: 400.0, 2: 200.0, 4: 100.0},
                            activation_mib_per_sample={1: 40.0, 2: 20.0, 4: 10.0})
    return ModelProfile(
        model_name="tiny",
        precision=precision,
        megatron_sp=megatron_sp,
        layer_types=[
            LayerTypeProfile(
                name="decoder",
                num_layers=num_layers,
                hidden_size=1024,
                seq_length=512,
                forward_time=StaticTime(ms_per_sample=2.0),
                parameter_mib=64.0,
                activation_mib_per_sample={1: 10.0, 2: 6.0, 4: 4.0},
                checkpoint_activation_mib_per_sample=1.0,
            )
        ],
        vocab=VocabProfile(
            forward_time=StaticTime(ms_per_sample=1.0),
            memory_pp_off=vocab_mem,
            memory_pp_first=vocab_mem,
            memory_pp_last=vocab_mem,
        ),
    )


@pytest.fixture
def make_hw():
    """Factory of :func:`tiny_hardware` (test modules cannot import conftest under --import-mode=importlib)."""
    return tiny_hardware


@pytest.fixture
def make_model():
    """Factory of :func:`tiny_model`."""
    return tiny_model


@pytest.fixture
def tiny_hw() -> HardwareProfile:
    return tiny_hardware()


@pytest.fixture
def tiny() -> ModelProfile:
    return tiny_model()
