"""Step time of galva's ring attention against an all-gather context-parallel baseline, on 2 CPU ranks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime/bench_ring.py [--seq 1024] [--steps 8]

Why not ``torch.distributed.tensor.experimental.context_parallel``: it parallelizes attention by intercepting the
CUDA scaled-dot-product kernels (``aten._scaled_dot_product_flash_attention``, ``_efficient_attention``,
``_cudnn_attention`` and their backwards); on CPU, SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``, which
it does not intercept, so each rank would attend over its own chunks only (a wrong result, not a baseline). The
baseline here is the other usual form on the same model and ranks: all-gather every rank's keys and values
(differentiable: their gradients reduce-scatter back), then one SDPA of the local queries over the whole sequence
with the mask of their positions. Both sides are the same galva plan (tiny Llama, every layer and the vocabulary cp
2, fp32); only the attention function differs, swapped step by step in the same processes, each side first every
other step (whichever runs first after the barrier pays more: 1.12 vs 0.84 at seq 512 with a fixed order).

Overlap: every ring call's time blocked waiting for a key/value block (exposed transfer) is summed over a step and set
against the same blocks sent alone (isend / irecv of the same bytes, as many as the ring sends): overlap =
1 - exposed / alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.functional import scaled_dot_product_attention

from galva_comm.testing import run_distributed


def allgather_attention(query, key, value, mask, group, index, scale):  # type: ignore[no-untyped-def]
    """Baseline: the whole sequence's keys and values on every rank, then one SDPA with the positions' mask."""
    from galva_hp.parallel.mappings import differentiable_all_gather
    from galva_hp.parallel.ring_attention import context_positions

    size = dist.get_world_size(group)
    local = query.shape[2]
    seq = local * size
    keys, values = (differentiable_all_gather(t.contiguous(), 2, group) for t in (key, value))
    k_pos = torch.cat([context_positions(seq, size, i, query.device) for i in range(size)])
    allowed = mask.block(context_positions(seq, size, index, query.device), k_pos)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    return scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scale)


def _rank(rank: int, world: int, seq: int, steps: int, warmup: int) -> dict[str, float]:
    import galva_hp.parallel.ring_attention as ring_module
    import galva_models.tables.attention as attention
    from galva_hp import BuildOptions, GalvaOptimizer, OptimConfig, build, train_step
    from galva_models import adapter_for
    from galva_models.data import RandomTokenSource
    from galva_models.presets import preset_config
    from galva_schema import Strategy

    torch.set_num_threads(1)
    config = preset_config("tiny-llama")
    config.max_position_embeddings = max(config.max_position_embeddings, seq)
    adapter = adapter_for(config)
    plan = Strategy.model_validate({"world_size": world, "pp": 1, "global_batch_size": 2, "num_micro_batches": 1,
                                    "mixed_precision": "fp32", "layers": [{"cp": world}] * config.num_hidden_layers,
                                    "vocab": {"cp": world}})  # fmt: skip
    models = {}
    for name in ("ring", "all-gather"):
        torch.manual_seed(0)
        built = build(adapter.decompose(adapter.build_model(config)), plan, BuildOptions(seq_len=seq))
        models[name] = (built, GalvaOptimizer(built.param_records(), OptimConfig(lr=1e-4)))
    functions = {"ring": ring_module.ring_attention, "all-gather": allgather_attention}
    source = RandomTokenSource(int(config.vocab_size), seq, 2, seed=1)
    waited = [0.0]
    plain_wait = ring_module._InFlight.wait

    def timed_wait(self):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = plain_wait(self)
        waited[0] += time.perf_counter() - start
        return out

    ring_module._InFlight.wait = timed_wait  # type: ignore[method-assign]
    times: dict[str, list[float]] = {name: [] for name in models}
    exposed: list[float] = []
    losses: dict[str, list[float]] = {name: [] for name in models}
    for step in range(warmup + steps):
        batch = source.batch(step)
        names = list(models) if step % 2 == 0 else list(models)[::-1]  # each side first every other step
        for name in names:
            built, optimizer = models[name]
            attention.ring_attention = functions[name]
            waited[0] = 0.0
            dist.barrier()
            start = time.perf_counter()
            metrics = train_step(built, optimizer, batch.inputs, batch.labels)
            dist.barrier()
            if step >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
                if name == "ring":
                    exposed.append(waited[0] * 1e3)
            losses[name].append(metrics.loss)
    attention.ring_attention = ring_module.ring_attention
    # the same blocks sent alone: per layer, 1 key/value shift forward, 1 key/value + 1 gradient shift backward
    layer = models["ring"][0].units[1].module.layer.self_attn
    kv = torch.randn(2 * 2 * layer.config.num_key_value_heads * (seq // world) * layer.head_dim)
    ring = ring_module._Ring(dist.group.WORLD, rank, seq // world)
    alone = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(config.num_hidden_layers):
            for _ in range(3 * (world - 1)):
                plain_wait(ring.shift(kv, 7))
        alone.append((time.perf_counter() - start) * 1e3)
    return {
        "ring_ms": statistics.median(times["ring"]),
        "allgather_ms": statistics.median(times["all-gather"]),
        # the ratio within each step (both sides a moment apart), then its median: robust to the load drifting
        "ratio": statistics.median(r / a for r, a in zip(times["ring"], times["all-gather"], strict=True)),
        "exposed_ms": statistics.median(exposed),
        "alone_ms": statistics.median(alone),
        "loss_diff": max(abs(a - b) / abs(b) for a, b in zip(losses["ring"], losses["all-gather"], strict=True)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    r = run_distributed(_rank, 2, args.seq, args.steps, args.warmup, timeout=1800)[0]
    ratio = r["ratio"]
    overlap = 1.0 - r["exposed_ms"] / r["alone_ms"] if r["alone_ms"] > 0 else float("nan")
    print(f"| tiny Llama cp 2, seq {args.seq}, 2 ranks | {r['ring_ms']:.1f} | {r['allgather_ms']:.1f} | {ratio:.3f} "
          f"| {r['exposed_ms']:.1f} of {r['alone_ms']:.1f} ms: {100 * overlap:.0f}% hidden | {r['loss_diff']:.1e} |")


if __name__ == "__main__":
    main()
