"""Inputs shared by both searches: Galvatron-format profiles and hardware files, prepared from the files that
hetu-galvatron 2.4.0 ships (see README.md for every conversion and extrapolation)."""

from __future__ import annotations

import json
import os
import shutil

MODEL_NAME = "hidden4096_head32_seqlen2048"  # LLaMA-7B layer: hidden 4096, 32 heads, seq 2048
HIDDEN, SEQ = 4096, 2048
# The computation file holds per-sample forward times at batch sizes 1..14; the reference's static time mode uses the
# first `layertype_0_*` key in file order, which is bsz 1 (spec §11.10). Galva is told to read the same entry.
STATIC_BATCH = 1


def prepare_profiles(galvatron_dir: str, out_dir: str) -> str:
    """LLaMA-7B model profiles in the layout hetu-galvatron 2.4.0's search reads.

    The shipped llama_hf memory profile has the old flat layout (no sequence key, scalar "other" model states) that
    2.4.0 can no longer read. The layer entry is kept as is under the key "2048"; the per-vocab-degree "other"
    entries come from the same file's `*_sp` sections (the only ones with per-degree values). The computation
    profile is copied unchanged.
    """
    os.makedirs(out_dir, exist_ok=True)
    src = os.path.join(galvatron_dir, "models", "llama_hf", "configs")
    shutil.copy(os.path.join(src, f"computation_profiling_bf16_{MODEL_NAME}.json"), out_dir)
    with open(os.path.join(src, f"memory_profiling_bf16_{MODEL_NAME}.json")) as f:
        mem = json.load(f)
    seq = str(SEQ)
    converted = {
        "layertype_0": {seq: mem["layertype_0"]},
        "other_memory_pp_off": {seq: mem["other_memory_pp_off_sp"]},
        "other_memory_pp_on_first": {seq: mem["other_memory_pp_on_first_sp"]},
        "other_memory_pp_on_last": {seq: mem["other_memory_pp_on_last_sp"]},
    }
    with open(os.path.join(out_dir, f"memory_profiling_bf16_{MODEL_NAME}.json"), "w") as f:
        json.dump(converted, f, indent=1)
    return out_dir


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _write(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def prepare_hardware(galvatron_dir: str, out_dir: str, nodes: int, gpus_per_node: int = 8) -> str:
    """Hardware files for `nodes` x 8 GPUs: the shipped ones for 1 and 2 nodes, extrapolated beyond.

    Extrapolation to N > 2 nodes (documented in README.md): groups inside a node keep the 2-node file's intra-node
    bandwidths; a consecutive group spanning several nodes gets the measured 16-GPU ring bandwidth (a ring's bus
    bandwidth does not depend on its length); a strided group of size <= 8 keeps the 2-node value of its size and a
    larger one the largest strided value (8 ranks); p2p between stages keeps the inter-node values, pp > 16 the
    16-stage one. sp_time (only read in `tp+sp` mode) is the 1-node file for every node count.
    """
    os.makedirs(out_dir, exist_ok=True)
    hw = os.path.join(galvatron_dir, "profile_hardware", "hardware_configs")
    shutil.copy(os.path.join(hw, "overlap_coefficient.json"), out_dir)
    tag = f"{nodes}nodes_{gpus_per_node}gpus_per_node"
    sp_src = os.path.join(hw, f"sp_time_1nodes_{gpus_per_node}gpus_per_node.json")
    shutil.copy(sp_src, os.path.join(out_dir, f"sp_time_{tag}.json"))
    if nodes <= 2:
        for kind in ("allreduce_bandwidth", "p2p_bandwidth"):
            shutil.copy(os.path.join(hw, f"{kind}_{tag}.json"), out_dir)
        return out_dir
    two = _read(os.path.join(hw, f"allreduce_bandwidth_2nodes_{gpus_per_node}gpus_per_node.json"))
    p2p_two = _read(os.path.join(hw, f"p2p_bandwidth_2nodes_{gpus_per_node}gpus_per_node.json"))
    world = nodes * gpus_per_node
    allreduce: dict[str, float] = {}
    size = world
    while size >= 2:
        if size <= gpus_per_node:
            allreduce[f"allreduce_size_{size}_consec_1"] = two[f"allreduce_size_{size}_consec_1"]
            allreduce[f"allreduce_size_{size}_consec_0"] = two[f"allreduce_size_{size}_consec_0"]
        else:
            allreduce[f"allreduce_size_{size}_consec_1"] = two[f"allreduce_size_{2 * gpus_per_node}_consec_1"]
            if size < world:
                allreduce[f"allreduce_size_{size}_consec_0"] = two[f"allreduce_size_{gpus_per_node}_consec_0"]
        size //= 2
    p2p = {}
    pp = 2
    while pp <= world:
        p2p[f"pp_size_{pp}"] = p2p_two.get(f"pp_size_{pp}", p2p_two[f"pp_size_{2 * gpus_per_node}"])
        pp *= 2
    _write(os.path.join(out_dir, f"allreduce_bandwidth_{tag}.json"), allreduce)
    _write(os.path.join(out_dir, f"p2p_bandwidth_{tag}.json"), p2p)
    return out_dir
