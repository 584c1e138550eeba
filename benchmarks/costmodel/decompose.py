"""Decompose a `galva run`'s measured step against the cost model's terms for the same plan (issue #21).

    python benchmarks/costmodel/decompose.py galva-run [--steps 6]

Reads the run's strategy, profiles and model config, runs the plan on its ranks (forked gloo, as `galva-profile
check`) and, step by step and interleaved in the same processes:

* **step**: the training step as galva-train times it (zero_grad, forward_backward, clip, AdamW), split into those
  phases, and per unit (embedding, layers.i, head; forward and backward hooks) with ``--timeline`` showing the gaps;
  ``--cpu`` times units and phases in the main thread's CPU time (waits left out, little moved by outside load),
  and every rank's process CPU time per step is printed beside it (gloo's threads included);
* **layer, all ranks**: one plain layer of the model (tp 1, the profile's module) forward + backward at the size the
  cost model prices a rank's layer at (``b / tp`` samples), every rank at once;
* **layer, rank 0 alone**: the same on rank 0 while the others wait (what the single-process model profile sees);
* **comm share**: on rank 0, for two steps under ``torch.profiler``, the self CPU time of communication ops
  (all-reduce, gathers, sends, waits) against the step's wall time;
* **tail** (``--tail``): the step's world all-reduces after the schedule (the loss's totals, the clip's squared
  norm) and the AdamW step, on the clock every process of the machine shares (``time.perf_counter``: one node), so
  ranks compare: each call from the last rank's arrival to the last rank's exit (what a step pays beyond its slowest
  rank), the ranks' mean wait in it, and each rank's step, beside the cost model's clip latency and optimizer terms.

It prints each beside the cost model's term: ``(1 + beta) * F(b/tp)`` (the model profile), times
``compute_slowdown`` (the hardware profile), and the predicted step with its breakdown. Ratios of things measured in
the same processes at the same time are what to compare on a shared machine; say the load (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

COMM = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "wait",
        "gloo", "c10d", "barrier", "all_to_all", "alltoall")


CLOCK = time.perf_counter  # of the unit spans, phases and timeline: wall, or the main thread's CPU time (--cpu)


def _rank(rank: int, world: int, run: str, steps: int, x: int, cpu_clock: bool, tail: bool = False) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from galva_hp import BuildOptions, GalvaOptimizer, OptimConfig, build
    from galva_models import adapter_for
    from galva_models.data import RandomTokenSource
    from galva_profiler.model_profile import layer_specs
    from galva_profiler.model_source import MetaModel, load_config
    from galva_schema import ModelProfile, Strategy

    global CLOCK
    CLOCK = time.thread_time if cpu_clock else time.perf_counter
    out = Path(run)
    strategy = Strategy.load(out / "strategy.json")
    profile = ModelProfile.load(out / "profiles" / "model.json")
    config, _ = load_config(None, str(out / "model"))
    seq = profile.layer_types[0].seq_length
    adapter = adapter_for(config)
    torch.manual_seed(0)
    model = build(adapter.decompose(adapter.build_model(config, attn_implementation="sdpa")), strategy,
                  BuildOptions(seq_len=seq))
    optimizer = GalvaOptimizer(model.param_records(), OptimConfig(lr=1e-4))
    source = RandomTokenSource(int(config.vocab_size), seq, strategy.global_batch_size, 0)
    meta = MetaModel.build(config, "")
    layer = meta.layer(0, torch.float32).train()
    hidden = layer_specs(meta, seq)[0].hidden_size
    xin = torch.randn(x, seq, hidden, requires_grad=True)

    phases: dict[str, list[float]] = {}

    cpu: dict[str, list[float]] = {"step": [], "layer": [], "thread_step": []}
    calls: list[tuple[int, float, float]] = []  # (elements, entry, exit) of each blocking all-reduce, perf_counter
    tails: list[dict[str, Any]] = []
    if tail:
        plain_all_reduce = dist.all_reduce

        def logged(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            entry = time.perf_counter()
            work = plain_all_reduce(tensor, *args, **kwargs)
            if not kwargs.get("async_op", False):
                calls.append((tensor.numel(), entry, time.perf_counter()))
            return work

        dist.all_reduce = logged

    def train() -> float:
        batch = source.batch(0)
        dist.barrier()
        calls.clear()
        marks_s = [time.perf_counter()]
        c0, h0 = time.process_time(), time.thread_time()
        t = [CLOCK()]
        timeline.clear()
        timeline.append(("start", t[0]))
        optimizer.zero_grad()
        t.append(CLOCK())
        model.forward_backward(batch.inputs, batch.labels)
        t.append(CLOCK())
        marks_s.append(time.perf_counter())
        optimizer.clip_grad_norm()
        t.append(CLOCK())
        marks_s.append(time.perf_counter())
        optimizer.step()
        model.after_step()
        t.append(CLOCK())
        marks_s.append(time.perf_counter())
        if tail:  # the last two blocking all-reduces: the loss's totals, then the clip's norm
            tails.append({"marks": marks_s, "calls": calls[-2:]})
        timeline.extend(zip(("zero_grad.", "forward_backward.", "clip.", "step."), t[1:]))
        cpu["step"].append(time.process_time() - c0)
        cpu["thread_step"].append(time.thread_time() - h0)
        for name, a, b in zip(("zero_grad", "forward_backward", "clip", "step"), t, t[1:]):
            phases.setdefault(name, []).append(b - a)
        return t[-1] - t[0]

    def one_layer() -> float:
        t0, c0 = time.perf_counter(), time.process_time()
        out_ = layer(xin)
        (out_[0] if isinstance(out_, tuple) else out_).backward(
            torch.ones_like(out_[0] if isinstance(out_, tuple) else out_))
        cpu["layer"].append(time.process_time() - c0)
        return time.perf_counter() - t0

    spans: dict[str, list[float]] = {}
    marks: dict[str, float] = {}

    timeline: list[tuple[str, float]] = []

    def opened(key: str) -> Any:
        def hook(*_: Any) -> None:
            marks[key] = CLOCK()
            timeline.append((key + " <", marks[key]))
        return hook

    def closed(key: str) -> Any:
        def hook(*_: Any) -> None:
            now = CLOCK()
            spans.setdefault(key, []).append(now - marks.pop(key, now))
            timeline.append((key + " >", now))
        return hook

    for unit in model.units:
        unit.module.register_forward_pre_hook(opened(f"{unit.name} fwd"))
        unit.module.register_forward_hook(closed(f"{unit.name} fwd"))
        unit.module.register_full_backward_pre_hook(opened(f"{unit.name} bwd"))
        unit.module.register_full_backward_hook(closed(f"{unit.name} bwd"))
    for _ in range(2):
        train()
        one_layer()
    spans.clear()
    phases.clear()
    for v in cpu.values():
        v.clear()
    rows: dict[str, list[float]] = {"step": [], "layer_all": [], "layer_alone": []}
    for _ in range(steps):
        rows["step"].append(train())
        dist.barrier()
        rows["layer_all"].append(statistics.median(one_layer() for _ in range(3)))
        dist.barrier()
        if rank == 0:
            rows["layer_alone"].append(statistics.median(one_layer() for _ in range(3)))
        dist.barrier()
    train()
    last = [(name, (at - timeline[0][1]) * 1e3) for name, at in timeline]
    if tail:
        tails.clear()
        for _ in range(steps):
            train()
        dist.all_reduce = plain_all_reduce
    kept_tails = list(tails)  # not the profiled steps' below
    comm_share = None
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = sum(train() for _ in range(2))
    if rank == 0:
        comm = sum(e.self_cpu_time_total for e in prof.key_averages() if any(k in e.key.lower() for k in COMM)) * 1e-6
        comm_share = comm / wall
    return {"rank": rank, **{k: statistics.median(v) if v else None for k, v in rows.items()},
            "comm_share": comm_share, "units": {k: statistics.median(v) for k, v in spans.items()},
            "timeline": last, "cpu": {k: statistics.median(v) for k, v in cpu.items() if v}, "tail": kept_tails,
            "phases": {k: statistics.median(v) for k, v in phases.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeline", action="store_true", help="print rank 0's unit timeline of one step")
    parser.add_argument("--cpu", action="store_true",
                        help="units, phases and timeline in the main thread's CPU time (load-robust), not wall")
    parser.add_argument("--tail", action="store_true",
                        help="time the step's tail: the loss's and the clip's world all-reduces and the AdamW step")
    parser.add_argument("--json", action="store_true", help="print every rank's raw numbers")
    args = parser.parse_args()
    from galva_comm.testing import run_distributed
    from galva_schema import HardwareProfile, ModelProfile, Strategy
    from galva_search.cost_model import CostModel, CostSettings
    from galva_search.evaluation import evaluate_strategy

    strategy = Strategy.load(args.run / "strategy.json")
    hw = HardwareProfile.load(args.run / "profiles" / "hardware.json")
    mp = ModelProfile.load(args.run / "profiles" / "model.json")
    layer = strategy.layers[0]
    b = strategy.micro_batch_size // (strategy.world_size // (strategy.pp * layer.tp * layer.cp))
    x = max(1, b // layer.tp)
    results = run_distributed(
        _rank, strategy.world_size, str(args.run), args.steps, x, args.cpu, args.tail, timeout=900
    )
    r0 = next(r for r in results if r["rank"] == 0)
    slowest_step = max(r["step"] for r in results)
    ev = evaluate_strategy(CostModel(hw, mp, CostSettings()), strategy)
    t = mp.layer_types[0].forward_time
    f_ms = t.slope_ms_per_sample * x + t.intercept_ms if t.form == "batch" else float("nan")
    kappa = hw.compute_slowdown
    print(f"plan: {strategy.describe()}; local samples b={b}, priced layer size x=b/tp={x}")
    print(f"step: measured {slowest_step * 1e3:.1f} ms (median, slowest rank) / predicted "
          f"{ev.iteration_time_s * 1e3:.1f} ms = {slowest_step / ev.iteration_time_s:.2f}x")
    parts = ev.detail.time_breakdown_s(strategy.num_micro_batches) if ev.detail else {}
    print("predicted breakdown (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()))
    print(f"one layer fwd+bwd at x={x}: profile (1+2)F = {3 * f_ms:.2f} ms, x kappa {kappa:.2f} = "
          f"{3 * f_ms * kappa:.2f} ms; measured alone {r0['layer_alone'] * 1e3:.2f} ms, all ranks at once "
          f"{r0['layer_all'] * 1e3:.2f} ms (live kappa {r0['layer_all'] / r0['layer_alone']:.2f})")
    print(f"rank 0 communication ops' self CPU share of the step: {r0['comm_share']:.1%}")
    units = r0["units"]
    print("rank 0 per unit (median ms, forward / backward hooks): " + ", ".join(
        f"{k} {v * 1e3:.1f}" for k, v in units.items()))
    print(f"units' sum {sum(units.values()) * 1e3:.1f} ms of the step's {r0['step'] * 1e3:.1f} ms")
    # rank 0's own layers (its stage's, under a pipeline), each with a forward and a backward span
    own_layers = {k.split()[0] for k in units if k.startswith("layers.")}
    in_step = sum(v for k, v in units.items() if k.startswith("layers.")) / max(1, len(own_layers))
    form = "ulysses" if layer.ulysses else ("megatron_sp" if strategy.megatron_sp else "tp")
    overhead = sum(mp.layer_types[0].parallel_overhead_ms.get(form, {}).get(layer.tp, (0.0, 0.0)))
    dp_type = (layer.dp_type or strategy.default_dp_type).value
    if dp_type != "ddp":  # a ZeRO unit's own forward + backward per call (the profile's sharded_overhead_ms)
        by_degree = mp.layer_types[0].sharded_overhead_ms.get(dp_type, {})
        degree = max((d for d in by_degree if d <= strategy.world_size // (strategy.pp * layer.tp)), default=None)
        overhead += sum(by_degree[degree][:2]) if degree is not None else 0.0
        form = f"{form} + {dp_type}"
    plain = r0["cpu"]["layer"] if args.cpu else r0["layer_all"]
    print(f"a layer inside the step (fwd + bwd, mean) {in_step * 1e3:.2f} ms against the plain layer at b/tp beside "
          f"it {plain * 1e3:.2f} ms ({in_step / plain:.2f}x); the profile's {form} {layer.tp} overhead {overhead:.2f} "
          f"ms makes it {(plain * 1e3 + overhead) / (in_step * 1e3):.2f} of the measured")
    cpus = [r["cpu"] for r in results]
    print("CPU seconds per rank (median): step " + ", ".join(f"{c['step'] * 1e3:.1f}" for c in cpus)
          + " ms (main thread " + ", ".join(f"{c['thread_step'] * 1e3:.1f}" for c in cpus) + "); one layer "
          + ", ".join(f"{c['layer'] * 1e3:.2f}" for c in cpus) + " ms")
    print("rank 0 phases (median ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r0["phases"].items()))
    if args.tail:
        _print_tail(results, CostModel(hw, mp, CostSettings().for_strategy(strategy)), strategy.world_size)
    if args.timeline:
        print("rank 0 timeline of one step (ms, gaps over 3 ms marked):")
        prev = 0.0
        for name, at in r0["timeline"]:
            print(f"  {at:8.1f} {name}" + (f"   <- gap {at - prev:.1f}" if at - prev > 3 else ""))
            prev = at
    if args.json:
        print(json.dumps(results))


def _print_tail(results: list[dict[str, Any]], cost: Any, world: int) -> None:
    """The tail's calls and step, medians over the steps, beside their prices (``--tail``)."""
    steps = min(len(r["tail"]) for r in results)
    rows: dict[str, list[float]] = {}

    def add(key: str, ms: float) -> None:
        rows.setdefault(key, []).append(ms)

    for k in range(steps):
        tails = [r["tail"][k] for r in results]
        add("barrier release spread", 1e3 * (max(t["marks"][0] for t in tails) - min(t["marks"][0] for t in tails)))
        for index, name in enumerate(("loss all-reduce", "clip all-reduce")):
            entries = [t["calls"][index][1] for t in tails if len(t["calls"]) == 2]
            exits = [t["calls"][index][2] for t in tails if len(t["calls"]) == 2]
            if len(entries) == len(tails):
                add(f"{name}: last arrival to last exit", 1e3 * (max(exits) - max(entries)))
                add(f"{name}: ranks' mean time inside", 1e3 * statistics.mean(b - a for a, b in zip(entries, exits)))
        add("clip (norm + all-reduce), slowest rank", 1e3 * max(t["marks"][2] - t["marks"][1] for t in tails))
        add("AdamW step, slowest rank", 1e3 * max(t["marks"][3] - t["marks"][2] for t in tails))
        add("last schedule end to last step end", 1e3 * (max(t["marks"][3] for t in tails)
                                                         - max(t["marks"][1] for t in tails)))
    print(f"tail of the step ({steps} steps, median ms; one node's shared clock):")
    for key, values in rows.items():
        print(f"  {key}: {statistics.median(values):.2f}")
    print(f"  priced: loss all-reduce {cost.comm.allreduce_latency(world, busy=False) * 1e3:.2f} (curve's smallest "
          f"point), clip all-reduce {cost.comm.allreduce_latency(world) * 1e3:.2f} (with the busy extra), "
          f"optimizer call {cost.optimizer_call_s() * 1e3:.2f} (both included)")


if __name__ == "__main__":
    main()
