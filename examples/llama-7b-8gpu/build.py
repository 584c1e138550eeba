"""Convert the reference system's (Galvatron's) published LLaMA-7B profiles into Galva's profile files.

    python examples/llama-7b-8gpu/build.py        # rewrites hardware.json and model.json next to this file

Needs galva-schema only (no torch). Sources, copied unchanged into ``galvatron/`` (Galvatron at commit 14f5972,
described in the spec's §10):

* ``galvatron/profile_hardware/hardware_configs/{allreduce_bandwidth,p2p_bandwidth,sp_time}_1nodes_8gpus_per_node.json``
  and ``overlap_coefficient.json``: one node of 8 NVLink-connected GPUs (all-reduce bus bandwidth 138-159 GB/s,
  A100-class; the reference does not name the GPU);
* ``galvatron/models/llama_hf/configs/{computation,memory}_profiling_bf16_hidden4096_head32_seqlen2048.json``: one
  LLaMA-7B decoder layer (hidden 4096, 32 heads, sequence 2048, bf16), the vocabulary layers, and their memory.
  LLaMA-2-7B has the same layer shapes (it differs in training data and a 4096 context), so the numbers stand for
  both. The model has 32 layers and a vocabulary of 32000 (the files do not carry these; the model's config does).
"""

from __future__ import annotations

from pathlib import Path

from galva_schema import HardwareProfile, ModelProfile
from galva_schema.reference import read_galvatron_hardware, read_galvatron_model_profile

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "galvatron"
GIB = 1024.0


def convert() -> tuple[HardwareProfile, ModelProfile]:
    """The two profiles, converted from the reference's files in ``galvatron/``."""
    hardware = read_galvatron_hardware(SOURCE, num_nodes=1, gpus_per_node=8, device_memory_mib=40 * GIB,
                                       device_name="8-GPU NVLink node (Galvatron's published 1x8 profile)")
    model = read_galvatron_model_profile(
        SOURCE / "computation_profiling_bf16_hidden4096_head32_seqlen2048.json",
        SOURCE / "memory_profiling_bf16_hidden4096_head32_seqlen2048.json",
        model_name="llama-7b (Galvatron's published profile)", num_layers=[32], hidden_sizes=[4096],
        seq_lengths=[2048], vocab_size=32000,
    )
    return hardware, model


def build() -> tuple[Path, Path]:
    hardware, model = convert()
    return hardware.save(HERE / "hardware.json"), model.save(HERE / "model.json")


if __name__ == "__main__":
    for path in build():
        print(f"wrote {path}")
