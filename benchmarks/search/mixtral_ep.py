"""Mixtral-8x7B on 64 A100-class GPUs: the per-layer search (attention and expert layouts chosen per layer) against
the best uniform plan (one tp / pp / ep / etp / dp type / checkpointing for every layer, as a Megatron user writes
it), both by galva-search on the same profiles.

    .venv/bin/python benchmarks/search/mixtral_ep.py [--memory-gb 80 40] [--write-profiles DIR]

Inputs (stated here, built in memory; see README.md "Mixtral-8x7B, 64 GPUs"):

* hardware: the shipped 1x8 A100-class profile (``examples/llama-7b-8gpu/hardware.json``, Galvatron's published
  node) for groups inside a node, joined into 8 nodes with the inter-node bus bandwidths this directory's README
  states for Galvatron's 2-node file (consecutive groups over nodes 44.68 GB/s; strided groups of 2 / 4 / 8 ranks
  8.13 / 16.22 / 20.77 GB/s, 20.77 above); p2p between stages on different nodes 8.13 GB/s (the 2-rank strided
  figure: one pair across nodes); all-to-all inside a node from the shipped curves, across nodes from the bus
  bandwidth (galva-search's fallback);
* model: Mixtral-8x7B shapes (hidden 4096, 32 layers, 32 heads / 8 kv heads, 8 experts of FFN 14336, top-2,
  vocabulary 32000), sequence 4096, bf16. Times from FLOPs at the rate the shipped LLaMA-7B profile implies
  (4.79 ms per sample per layer at sequence 2048: 438 MFLOP per token, 187 TFLOP/s); one expert's call 0.02 ms
  on top of its rows; routing imbalance 1.0 / 1.05 / 1.10 / 1.20 for ep 1 / 2 / 4 / 8 (assumed, not measured);
  activations from the tensor shapes (below).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from galva_schema import (
    AllreduceBandwidth,
    BatchTime,
    ClusterSpec,
    DataParallelType,
    ExpertProfile,
    HardwareProfile,
    LayerTypeProfile,
    ModelProfile,
    P2PBandwidth,
    Precision,
    StaticTime,
    VocabMemory,
    VocabProfile,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MIB = 2**20
H, LAYERS, HEADS, KV, F, E, K, V, S = 4096, 32, 32, 8, 14336, 8, 2, 32000, 4096
RATE = 2048 * 438.0e6 / 4.79e-3  # FLOP/s the LLaMA-7B profile implies (4.79 ms per sample of 2048 tokens)
INTER_CONSECUTIVE = 44.68
INTER_STRIDED = {2: 8.13, 4: 16.22, 8: 20.77}
NODES, GPUS = 8, 8


def hardware() -> HardwareProfile:
    node = HardwareProfile.load(ROOT / "examples" / "llama-7b-8gpu" / "hardware.json")
    inside = {(a.group_size, a.consecutive): a.bus_bandwidth_gb_per_s for a in node.allreduce}
    allreduce = []
    size = 2
    while size <= NODES * GPUS:
        if size <= GPUS:
            allreduce.append(AllreduceBandwidth(group_size=size, consecutive=True,
                                                bus_bandwidth_gb_per_s=inside.get((size, True), inside[(8, True)])))
        else:
            allreduce.append(AllreduceBandwidth(group_size=size, consecutive=True,
                                                bus_bandwidth_gb_per_s=INTER_CONSECUTIVE))
        if size < NODES * GPUS:
            allreduce.append(AllreduceBandwidth(group_size=size, consecutive=False,
                                                bus_bandwidth_gb_per_s=INTER_STRIDED.get(size, INTER_STRIDED[8])))
        size *= 2
    p2p = [P2PBandwidth(pp=pp, bandwidth_gb_per_s=INTER_STRIDED[2]) for pp in (2, 4, 8, 16, 32, 64)]
    return node.model_copy(update={
        "cluster": ClusterSpec(num_nodes=NODES, gpus_per_node=GPUS, device_memory_mib=80 * 1024.0,
                               device_name="A100-80GB-class (Galvatron's 1x8 node, 8 nodes joined as stated)"),
        "allreduce": tuple(allreduce), "p2p": tuple(p2p),  # tuples, as validation makes them (written unwarned)
        "all_gather_time": (), "reduce_scatter_time": (),
    })  # fmt: skip


def model() -> ModelProfile:
    attention_params = H * (H + 2 * H * KV // HEADS + H)
    expert_params = E * 3 * H * F
    router = H * E
    norms = 2 * H
    flops_token = 2 * attention_params + 4 * S * H + K * 2 * 3 * H * F  # attention projections + scores + 2 experts
    ms_sample = S * flops_token / RATE * 1e3
    b = 2  # bf16 bytes
    # activations per sample (bytes), by tp: norms + attention inputs kept whole, projections and attention out
    # split by tp (flash attention: no s^2 term); experts: per routed row its input, gate/up output, activation
    # and product (h + 2F + F + F elements), on the rank's 1/tp of the tokens
    def dense(tp: int) -> float:
        return S * H * b * (4 + 6 / tp)

    per_row = (H + 4 * F) * b

    def acts(tp: int) -> float:
        return (dense(tp) + S / tp * K * per_row) / MIB

    vocab_states = V * H * 18 / MIB  # bf16 as galva-hp holds it, per vocabulary matrix
    return ModelProfile(
        model_name="mixtral-8x7b (shapes)", precision=Precision.BF16,
        layer_types=[LayerTypeProfile(
            name="decoder", num_layers=LAYERS, hidden_size=H, seq_length=S,
            forward_time=StaticTime(ms_per_sample=ms_sample),
            parameter_mib=(attention_params + expert_params + router + norms) * 4 / MIB,
            activation_mib_per_sample={t: acts(t) for t in (1, 2, 4, 8)},
            checkpoint_activation_mib_per_sample=S * H * b / MIB,
            experts=ExpertProfile(
                num_experts=E, top_k=K, expert_ffn=F, expert_parameter_mib=expert_params * 4 / MIB,
                block_parameter_mib=router * 4 / MIB,
                expert_time=BatchTime(slope_ms_per_sample=2 * 3 * H * F / RATE * 1e3, intercept_ms=0.02),
                router_ms_per_token=2 * H * E / RATE * 1e3,
                imbalance={1: 1.0, 2: 1.05, 4: 1.10, 8: 1.20},
                activation_mib_per_row=per_row / MIB,
                dispatch_activation_mib_per_row=(H * b + 16) / MIB,
            ),
        )],
        vocab=VocabProfile(
            vocab_size=V, forward_time=StaticTime(ms_per_sample=S * 2 * 2 * H * V / RATE * 1e3),
            memory_pp_off=VocabMemory(model_states_mib={t: 2 * vocab_states / t for t in (1, 2, 4, 8)},
                                      activation_mib_per_sample={t: S * V * 4 / MIB / t for t in (1, 2, 4, 8)}),
            memory_pp_first=VocabMemory(model_states_mib={t: vocab_states / t for t in (1, 2, 4, 8)},
                                        activation_mib_per_sample={t: S * H * b / MIB for t in (1, 2, 4, 8)}),
            memory_pp_last=VocabMemory(model_states_mib={t: vocab_states / t for t in (1, 2, 4, 8)},
                                       activation_mib_per_sample={t: S * V * 4 / MIB / t for t in (1, 2, 4, 8)}),
        ),
    )  # fmt: skip


def run(batch: int, memory_gb: float, micro_batches: int | None) -> dict:
    from galva_search.cost_model import CostModel, CostSettings
    from galva_search.search import SearchOptions, search
    from galva_search.space import SpaceOptions

    cost = CostModel(hardware(), model(), CostSettings(precision=Precision.BF16,
                                                       default_dp_type=DataParallelType.ZERO2))
    out = {}
    # the last row: the per-layer search with the experts replicated (max_ep 1): what expert parallelism gains
    for name, fine, max_ep in (("per-layer", True, 64), ("uniform", False, 64), ("per-layer, no ep", True, 1)):
        options = SearchOptions(memory_budget_mib=memory_gb * 1024.0, batch_sizes=(batch,), fine_grained=fine,
                                space=SpaceOptions(default_dp_type=DataParallelType.ZERO2, max_ep=max_ep), threads=1,
                                num_micro_batches=micro_batches)
        start, cpu = time.perf_counter(), time.process_time()
        result = search(cost, options)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        out[name] = {
            "search_s": seconds,
            "search_cpu_s": cpu_seconds,
            "iteration_s": result.summary.iteration_time_s,
            "plan": describe(result),
        }
    out["gain over uniform"] = out["uniform"]["iteration_s"] / out["per-layer"]["iteration_s"] - 1.0
    out["gain over no ep"] = out["per-layer, no ep"]["iteration_s"] / out["per-layer"]["iteration_s"] - 1.0
    return out


def _label(c) -> str:
    """One layer's plan in the reference's compact form plus the expert layout: ``pp-tp-dp[f|z2|d][-c][-sp][-epE[xT]]``
    (the experts' dp type added when it differs from the layer's; ZeRO-2 is this run's default)."""
    short = {DataParallelType.DDP: "d", DataParallelType.ZERO2: "", DataParallelType.ZERO3: "f"}
    text = f"{c.pp}-{c.tp}-{c.dp}{short[c.dp_type]}" + "-c" * c.checkpoint + "-sp" * c.ulysses
    if c.ep > 1 or c.etp > 1:
        text += f"-ep{c.ep}" + (f"x{c.etp}" if c.etp > 1 else "")
        if c.expert_dp_type is not None and c.expert_dp_type is not c.dp_type:
            text += short[c.expert_dp_type] or "z2"
    return text


def describe(result) -> str:
    s = result.strategy
    runs: list[list] = []
    for c in result.candidates:
        label = _label(c)
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    layers = ", ".join(f"{n}x {label}" for label, n in runs)
    return f"pp {s.pp} c {s.num_micro_batches} {s.pipeline_schedule.value}: {layers}"


def write_profiles(directory: Path, batch: int, memory_gb: float, micro_batches: int) -> str:
    """Write the two profiles ``run`` searches on and return the ``galva-search`` command that repeats its
    per-layer row: the same budget, batch, micro-batches, ZeRO-2 default and base memory (1024 MiB, CostSettings's
    default, which ``run`` prices with)."""
    directory.mkdir(parents=True, exist_ok=True)
    hardware().save(directory / "hardware.json")
    model().save(directory / "model.json")
    fixed = f" --num-micro-batches {micro_batches}" if micro_batches else ""
    return (
        f"galva-search --hardware-profile {directory / 'hardware.json'} --model-profile {directory / 'model.json'} "
        f"--memory {memory_gb:g}GiB --global-batch-size {batch}{fixed} --default-dp-type zero2 "
        f"--context-memory 1024MiB --output {directory / 'plan.json'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--memory-gb", type=float, nargs="+", default=[80.0, 40.0],
                        help="device memory budgets, one run each (default: A100 80 GB and 40 GB)")
    parser.add_argument("--micro-batches", type=int, default=8, help="fixed count (0: every count)")
    parser.add_argument("--write-profiles", type=Path, metavar="DIR",
                        help="only write DIR/hardware.json and DIR/model.json and print the galva-search command "
                        "that runs the per-layer search on them (for timing the whole command)")
    args = parser.parse_args()
    if args.write_profiles is not None:
        print(write_profiles(args.write_profiles, args.batch, args.memory_gb[0], args.micro_batches))
        return
    runs = {f"{gb:g} GB": run(args.batch, gb, args.micro_batches or None) for gb in args.memory_gb}
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
