"""Long-context LLaMA-7B profiles for 64 GPUs (8 nodes x 8), derived from the 8-GPU example's converted profiles.

    python examples/llama-7b-64gpu-long-context/build.py   # writes hardware.json, model-32k.json, model-128k.json

Needs galva-schema only. Every figure comes from ``../llama-7b-8gpu`` (Galvatron's published profiles, sequence
2048) by the rules below; nothing here was measured at 32k or 128k.

Sequence scaling (from S0 = 2048 to S):

* forward time per sample = linear part x S/S0 + attention core x (S/S0)^2. The 2048-token 4.79 ms is split by
  forward FLOPs per token: linear 2 (4 H^2 + 3 H F) = 404.8 M (H 4096, F 11008), causal core 2 S H = 16.8 M at
  2048 (3.98 %), both at the same FLOP rate. The result is a ``sequence`` forward time ``(a, b, 0)`` and an
  ``attention_core`` of ``(a, 0, 0)`` with 2 x 4096 x 2 key/value bytes per token (32 key/value heads, bf16).
* activations (every tp entry and the checkpointed input) x S/S0: a flash attention keeps no S^2 scores.
* vocabulary: time and activations x S/S0; states unchanged.

Hardware: 64 ranks on 8 nodes. Groups inside a node (consecutive 2, 4, 8) keep the node's measured curves and bus
bandwidths; larger consecutive groups get 44.68 GB/s and strided groups 8.13 / 16.22 / 20.77 GB/s for 2 / 4 / 8
ranks and 20.77 above (the extrapolation of benchmarks/search/README.md from Galvatron's 2-node files). p2p: pipeline
neighbours 4, 2, 1 ranks apart (pp 16, 32, 64) get the node's pp 2, 4, 8 figures (163.67, 138.58, 109.45 GB/s);
neighbours on other nodes (pp 2, 4, 8) 20.77 GB/s, the only inter-node point-to-point figure assumed here.
Devices: 80 GiB (A100-80GB class).
"""

from __future__ import annotations

from pathlib import Path

from galva_schema import AttentionCoreProfile, HardwareProfile, ModelProfile, SequenceTime, StaticTime, VocabMemory

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "llama-7b-8gpu"
S0, H, F = 2048, 4096, 11008
SEQUENCES = {"32k": 32768, "128k": 131072}


def hardware() -> HardwareProfile:
    node = HardwareProfile.load(SOURCE / "hardware.json")
    data = node.model_dump(mode="json")
    data["cluster"].update(num_nodes=8, device_memory_mib=80 * 1024.0, device_name="8 x 8 A100-class GPUs (derived)")
    allreduce = [e for e in data["allreduce"] if e["group_size"] <= 8 and e["consecutive"]]
    allreduce += [{"group_size": n, "consecutive": True, "bus_bandwidth_gb_per_s": 44.68} for n in (16, 32, 64)]
    strided = {2: 8.13, 4: 16.22, 8: 20.77, 16: 20.77, 32: 20.77}
    allreduce += [{"group_size": n, "consecutive": False, "bus_bandwidth_gb_per_s": b} for n, b in strided.items()]
    data["allreduce"] = allreduce
    inside = {e["pp"]: e["bandwidth_gb_per_s"] for e in data["p2p"]}  # pp 2, 4, 8 of one node: 4, 2, 1 apart
    data["p2p"] = [{"pp": pp, "bandwidth_gb_per_s": 20.77} for pp in (2, 4, 8)]
    data["p2p"] += [{"pp": 8 * pp, "bandwidth_gb_per_s": inside[pp]} for pp in (2, 4, 8)]
    return HardwareProfile.model_validate(data)


def _scaled(table: dict[int, float], k: float) -> dict[int, float]:
    return {degree: mib * k for degree, mib in table.items()}


def model(seq: int) -> ModelProfile:
    base = ModelProfile.load(SOURCE / "model.json")
    layer = base.layer_types[0]
    assert isinstance(layer.forward_time, StaticTime)
    linear_flops, core_flops = 2 * (4 * H * H + 3 * H * F), 2 * S0 * H
    ms = layer.forward_time.ms_per_sample
    core_ms = ms * core_flops / (linear_flops + core_flops)
    a, b = core_ms / S0**2, (ms - core_ms) / S0
    k = seq / S0
    scaled = layer.model_copy(
        update={
            "seq_length": seq,
            "forward_time": SequenceTime(coefficients=(a, b, 0.0)),
            "activation_mib_per_sample": _scaled(layer.activation_mib_per_sample, k),
            "checkpoint_activation_mib_per_sample": layer.checkpoint_activation_mib_per_sample * k,
            "attention_core": AttentionCoreProfile(
                forward_time=SequenceTime(coefficients=(a, 0.0, 0.0)), kv_bytes_per_token=2 * H * 2
            ),
        }
    )
    vocab = base.vocab
    assert isinstance(vocab.forward_time, StaticTime)

    def memory(m: VocabMemory) -> VocabMemory:
        return m.model_copy(update={"activation_mib_per_sample": _scaled(m.activation_mib_per_sample, k)})

    vocab = vocab.model_copy(
        update={
            "forward_time": StaticTime(ms_per_sample=vocab.forward_time.ms_per_sample * k),
            "memory_pp_off": memory(vocab.memory_pp_off),
            "memory_pp_first": memory(vocab.memory_pp_first),
            "memory_pp_last": memory(vocab.memory_pp_last),
        }
    )
    name = f"llama-7b at {seq} tokens (derived from Galvatron's 2048-token profile)"
    return ModelProfile.model_validate(
        {
            **base.model_dump(mode="json"),
            "model_name": name,
            "layer_types": [scaled.model_dump(mode="json")],
            "vocab": vocab.model_dump(mode="json"),
        }
    )


def build() -> list[Path]:
    paths = [hardware().save(HERE / "hardware.json")]
    for tag, seq in SEQUENCES.items():
        paths.append(model(seq).save(HERE / f"model-{tag}.json"))
    return paths


if __name__ == "__main__":
    for path in build():
        print(f"wrote {path}")
