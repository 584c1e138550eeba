"""Expert parallelism on 4 CPU ranks: galva's ep2 and ep4 step time against the same model with the experts
replicated (ep1), and the all-to-all share of the step measured against galva-search's prediction.

    .venv/bin/python benchmarks/runtime/bench_ep.py            # about 4 minutes on 2 loaded cores

Not part of the test suite. One forked gloo world of 4 ranks (tp 1, dp 4); every plan is built in the same
processes and the plans are interleaved step by step. Model: tiny Mixtral (galva-models' ``tiny-mixtral``: hidden
64, 4 layers, 4 experts of FFN 128, top-2), sequence 64, global batch 8, fp32. A step is ``forward_backward``
(dispatch, experts, combine, gradient reductions). All-to-all time, two ways, each share the median over steps:
"inside": the wall time inside ``torch.distributed.all_to_all_single`` on the rank with the most (what the first
README table reported: it includes waiting inside each call for the last rank to arrive, i.e. the other ranks'
compute, routing imbalance and the outside load's descheduling); "own": per call, the time of the rank that spent
the least in it (the last to arrive: the collective's own latency and transfer), summed over the step's calls.
galva-search prices the second: the wait for the busiest rank is the compute term's imbalance.
The prediction is ``galva-profile model`` on this model and ``galva-profile hardware`` on this machine (4 ranks),
priced by ``galva_search.evaluation.evaluate_strategy`` and the layers' ``expert_comm_s``.

transformers' own expert parallelism (``from_pretrained(..., distributed_config=DistributedConfig(ep_size=4,
fsdp_size=4))``: its ``ep_dispatch_experts`` all-to-all dispatch, experts FSDP-sharded) runs on the same 4 gloo ranks
in a second forked world, the same model (saved from the same seed), tokens and batch per rank; its step is forward
+ backward (FSDP2's reduce-scatter included). It needs ``accelerate`` (not a Galva dependency): the row is left
out without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PLANS = {"ep1": 1, "ep2": 2, "ep4": 4}
WORLD, SEQ, BATCH, STEPS, WARMUP = 4, 64, 8, 8, 2


def strategy(ep: int) -> Any:
    from galva_schema import LayerStrategy, Strategy

    return Strategy(world_size=WORLD, pp=1, pp_division=[4], global_batch_size=BATCH, num_micro_batches=1,
                    mixed_precision="fp32", layers=[LayerStrategy(tp=1, ep=ep)] * 4)


def _rank(rank: int, world: int, config: Any) -> dict[str, list[tuple[float, list[float]]]]:
    import torch
    import torch.distributed as dist

    from galva_hp import BuildOptions, build
    from galva_models import adapter_for
    from galva_models.data import RandomTokenSource

    calls: list[float] = []
    plain = dist.all_to_all_single

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = plain(*args, **kwargs)
        calls.append(time.perf_counter() - t0)
        return out

    dist.all_to_all_single = timed  # type: ignore[assignment]
    adapter = adapter_for(config)
    models = {}
    for name, ep in PLANS.items():
        torch.manual_seed(0)
        hf = adapter.build_model(config, attn_implementation="sdpa")
        models[name] = build(adapter.decompose(hf), strategy(ep), BuildOptions(seq_len=SEQ))
    source = RandomTokenSource(int(config.vocab_size), SEQ, BATCH, 0)
    out: dict[str, list[tuple[float, list[float]]]] = {name: [] for name in PLANS}
    for step in range(WARMUP + STEPS):
        batch = source.batch(step)
        for name, model in models.items():
            dist.barrier()
            calls.clear()
            t0 = time.perf_counter()
            model.forward_backward(batch.inputs, batch.labels)
            wall = time.perf_counter() - t0
            if step >= WARMUP:
                out[name].append((wall, list(calls)))
    return out


def _hf_rank(rank: int, world: int, path: str, vocab: int) -> list[float]:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from galva_models.data import RandomTokenSource

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(ep_size=world,
                                                                                            fsdp_size=world))
    source = RandomTokenSource(vocab, SEQ, BATCH, 0)
    per_rank = BATCH // world
    out = []
    for step in range(WARMUP + STEPS):
        batch = source.batch(step)
        ids = batch.inputs[rank * per_rank:(rank + 1) * per_rank]
        labels = batch.labels[rank * per_rank:(rank + 1) * per_rank]
        dist.barrier()
        t0 = time.perf_counter()
        model(input_ids=ids, labels=labels).loss.backward()
        model.zero_grad(set_to_none=True)
        if step >= WARMUP:
            out.append(time.perf_counter() - t0)
    return out


def measure_transformers(work: Path) -> float | None:
    """Median step seconds of transformers' own ep 4 (None without ``accelerate``)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    from galva_comm.testing import run_distributed
    from galva_models.presets import preset_config

    if importlib.util.find_spec("accelerate") is None:
        return None
    config = preset_config("tiny-mixtral")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(work / "hf")
    ranks = run_distributed(_hf_rank, WORLD, str(work / "hf"), int(config.vocab_size), timeout=1200)
    return statistics.median(max(r[i] for r in ranks) for i in range(STEPS))


def measure() -> dict[str, dict[str, float]]:
    from galva_comm.testing import run_distributed
    from galva_models.presets import preset_config

    ranks = run_distributed(_rank, WORLD, preset_config("tiny-mixtral"), timeout=1200)
    result = {}
    for name in PLANS:
        steps = [max(r[name][i][0] for r in ranks) for i in range(STEPS)]
        inside = [max(sum(r[name][i][1]) for r in ranks) for i in range(STEPS)]
        # the same calls in the same order on every rank (collectives): per call, the last rank in
        own = [sum(map(min, zip(*(r[name][i][1] for r in ranks)))) for i in range(STEPS)]
        result[name] = {"step_s": statistics.median(steps), "a2a_s": statistics.median(own),
                        "a2a_share": statistics.median(a / s for a, s in zip(own, steps)),
                        "a2a_inside_share": statistics.median(a / s for a, s in zip(inside, steps)),
                        "a2a_calls": len(ranks[0][name][0][1])}
    return result


def predict(work: Path) -> dict[str, dict[str, float]]:
    from galva_schema import HardwareProfile, ModelProfile
    from galva_search.convert import candidate_of
    from galva_search.cost_model import CostModel, CostSettings
    from galva_search.evaluation import evaluate_strategy

    profile = [sys.executable, "-m", "galva_profiler.cli"]
    subprocess.run([*profile, "hardware", "--nproc-per-node", str(WORLD), "--quick", "--quiet", "-o",
                    str(work / "hw.json")], check=True)
    subprocess.run([*profile, "model", "--preset", "tiny-mixtral", "--seq-lengths", str(SEQ), "--batch-sizes",
                    "1,2", "--max-tp", "1", "--quiet", "-o", str(work / "m.json")], check=True)
    cost = CostModel(HardwareProfile.load(work / "hw.json"), ModelProfile.load(work / "m.json"),
                     CostSettings(context_mib=0.0, state_accounting="galva-hp"))
    out = {}
    for name, ep in PLANS.items():
        plan = strategy(ep)
        got = evaluate_strategy(cost, plan)
        terms = cost.layer_terms(0, [candidate_of(plan, 0)], BATCH, 1)
        a2a = float(terms.expert_comm_s[0]) * plan.num_layers
        out[name] = {"step_s": got.iteration_time_s, "a2a_s": a2a, "a2a_share": a2a / got.iteration_time_s}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=None, help="write the figures as JSON here")
    parser.add_argument("--no-transformers", action="store_true", help="leave out transformers' own EP")
    parser.add_argument("--profiles", metavar="DIR", help="keep the hardware and model profiles here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.profiles:
            Path(args.profiles).mkdir(parents=True, exist_ok=True)
        predicted = predict(Path(args.profiles or tmp))
        measured = measure()
        theirs = None if args.no_transformers else measure_transformers(Path(tmp))
    print("| plan | step ms measured | vs ep1 | step ms predicted | a2a calls | a2a share inside (largest rank) | "
          "a2a share own (measured) | a2a share predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for name in PLANS:
        m, p = measured[name], predicted[name]
        print(f"| {name} | {m['step_s'] * 1e3:.1f} | {m['step_s'] / measured['ep1']['step_s']:.3f} | "
              f"{p['step_s'] * 1e3:.1f} | {m['a2a_calls']} | {m['a2a_inside_share']:.1%} | {m['a2a_share']:.1%} | "
              f"{p['a2a_share']:.1%} |")
    if theirs is None:
        print("transformers ep 4: not run (needs accelerate)")
    else:
        print(f"| transformers ep4 (own EP, FSDP2 experts) | {theirs * 1e3:.1f} | "
              f"{theirs / measured['ep1']['step_s']:.3f} | | | | | |")
    if args.output:
        Path(args.output).write_text(json.dumps({"measured": measured, "predicted": predicted,
                                                 "transformers_ep4_step_s": theirs}, indent=1))


if __name__ == "__main__":
    main()
