"""Regenerate the small galva-format profiles used by galva-search's tests and benchmarks.

Run: .venv/bin/python packages/galva-search/tests/data/build_profiles.py

* ``llama7b_model.json``: a LLaMA-7B-like layer (reference spec §4.6: P = 773.25 MiB, activation by tp, checkpoint
  16 MiB, 4.79 ms per sample, H 4096, S 2048, 32 layers) with the §4.6 illustrative vocabulary memory.
* ``hw_1x8.json``: one 8-GPU node with the §4.6 coefficients (bandwidth = 1 / coe), p2p and overlap, and the n = 8
  all-reduce / all-to-all time curves of the §4.6 linear fits (the all-reduce fit is of halved times, so doubled).
* ``llama70b_model.json`` and ``hw_8x8.json``: an 80-layer LLaMA-70B-like model and eight such nodes joined by a
  slower network (inter-node groups ~20-45 GB/s); made-up but plausible numbers for the speed target.
"""

from __future__ import annotations

from pathlib import Path

from galva_schema import (
    AllreduceBandwidth,
    ClusterSpec,
    CollectiveTimes,
    HardwareProfile,
    LayerTypeProfile,
    ModelProfile,
    P2PBandwidth,
    StaticTime,
    VocabMemory,
    VocabProfile,
)

HERE = Path(__file__).parent
SIZES_MIB = tuple(float(2**i) for i in range(11))  # 1 .. 1024 MiB


def llama7b() -> ModelProfile:
    return ModelProfile(
        model_name="llama-7b-like",
        precision="bf16",
        layer_types=[
            LayerTypeProfile(
                name="decoder",
                num_layers=32,
                hidden_size=4096,
                seq_length=2048,
                forward_time=StaticTime(ms_per_sample=4.789421272277832),
                parameter_mib=773.2509765625,
                activation_mib_per_sample={1: 301.2817, 2: 182.1565, 4: 123.0939, 8: 93.5626},
                checkpoint_activation_mib_per_sample=16.0,
            )
        ],
        vocab=VocabProfile(
            vocab_size=32000,
            forward_time=StaticTime(ms_per_sample=3.8),
            memory_pp_off=VocabMemory(
                model_states_mib={1: 4258.0, 2: 2200.0, 4: 1150.0, 8: 600.0},
                activation_mib_per_sample={1: 572.5, 2: 300.0, 4: 160.0, 8: 90.0},
            ),
            memory_pp_first=VocabMemory(
                model_states_mib={1: 2157.0, 2: 1100.0, 4: 560.0, 8: 290.0},
                activation_mib_per_sample={1: 46.56, 2: 25.0, 4: 14.0, 8: 8.0},
            ),
            memory_pp_last=VocabMemory(
                model_states_mib={1: 2157.0, 2: 1100.0, 4: 560.0, 8: 290.0},
                activation_mib_per_sample={1: 500.0, 2: 260.0, 4: 140.0, 8: 75.0},
            ),
        ),
    )


def hw_1x8() -> HardwareProfile:
    coe = {(8, True): 0.0064850, (4, False): 0.0064179, (4, True): 0.0062846, (2, False): 0.0066075,
           (2, True): 0.0072382}
    p2p = {2: 0.0061098, 4: 0.0072160, 8: 0.0091366}
    ar_m, ar_c = 0.00400654, 0.08736331  # fit of halved all-reduce times
    a2a_m, a2a_c = 0.00460486, 0.11025102
    return HardwareProfile(
        cluster=ClusterSpec(num_nodes=1, gpus_per_node=8, device_memory_mib=81920.0, device_name="A100-like"),
        backend="nccl",
        allreduce=[AllreduceBandwidth(group_size=n, consecutive=c, bus_bandwidth_gb_per_s=1.0 / v)
                   for (n, c), v in coe.items()],
        p2p=[P2PBandwidth(pp=p, bandwidth_gb_per_s=1.0 / v) for p, v in p2p.items()],
        allreduce_time=[CollectiveTimes(group_size=8, message_mib=SIZES_MIB,
                                        time_ms=tuple(2 * (ar_m * m + ar_c) for m in SIZES_MIB))],
        all_to_all_time=[CollectiveTimes(group_size=8, message_mib=SIZES_MIB,
                                         time_ms=tuple(a2a_m * m + a2a_c for m in SIZES_MIB))],
        overlap_slowdown=1.1255526,
    )


def llama70b() -> ModelProfile:
    embed = 128256 * 8192 * 16 / 2**20  # states of one vocabulary matrix, 16 bytes per parameter
    return ModelProfile(
        model_name="llama-70b-like",
        precision="bf16",
        layer_types=[
            LayerTypeProfile(
                name="decoder",
                num_layers=80,
                hidden_size=8192,
                seq_length=4096,
                forward_time=StaticTime(ms_per_sample=42.0),
                parameter_mib=3265.0,
                activation_mib_per_sample={1: 1205.0, 2: 728.0, 4: 492.0, 8: 374.0},
                checkpoint_activation_mib_per_sample=64.0,
            )
        ],
        vocab=VocabProfile(
            vocab_size=128256,
            forward_time=StaticTime(ms_per_sample=50.0),
            memory_pp_off=VocabMemory(
                model_states_mib={k: 2 * embed / k for k in (1, 2, 4, 8)},
                activation_mib_per_sample={1: 2600.0, 2: 1300.0, 4: 650.0, 8: 325.0},
            ),
            memory_pp_first=VocabMemory(
                model_states_mib={k: embed / k for k in (1, 2, 4, 8)},
                activation_mib_per_sample={1: 64.0, 2: 32.0, 4: 16.0, 8: 8.0},
            ),
            memory_pp_last=VocabMemory(
                model_states_mib={k: embed / k for k in (1, 2, 4, 8)},
                activation_mib_per_sample={1: 2560.0, 2: 1280.0, 4: 640.0, 8: 320.0},
            ),
        ),
    )


def hw_8x8() -> HardwareProfile:
    consecutive = {2: 140.0, 4: 155.0, 8: 150.0, 16: 45.0, 32: 40.0, 64: 38.0}
    strided = {2: 20.0, 4: 21.0, 8: 22.0, 16: 25.0, 32: 30.0}
    allreduce = [AllreduceBandwidth(group_size=n, consecutive=True, bus_bandwidth_gb_per_s=v)
                 for n, v in consecutive.items()]
    allreduce += [AllreduceBandwidth(group_size=n, consecutive=False, bus_bandwidth_gb_per_s=v)
                  for n, v in strided.items()]
    return HardwareProfile(
        cluster=ClusterSpec(num_nodes=8, gpus_per_node=8, device_memory_mib=81920.0, device_name="H100-like"),
        backend="nccl",
        allreduce=allreduce,
        p2p=[P2PBandwidth(pp=p, bandwidth_gb_per_s=v) for p, v in {2: 20.0, 4: 20.0, 8: 20.0, 16: 20.0}.items()],
        overlap_slowdown=1.13,
    )


def main() -> None:
    for name, obj in (("llama7b_model", llama7b()), ("hw_1x8", hw_1x8()), ("llama70b_model", llama70b()),
                      ("hw_8x8", hw_8x8())):
        obj.save(HERE / f"{name}.json")
        print("wrote", HERE / f"{name}.json")


if __name__ == "__main__":
    main()
