"""CPU time of one galva-hp training step per rank on the test sweep's tiny models: what a family-sweep test pays.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime/step_cpu.py                 # every plan, llama
    .venv/bin/python benchmarks/runtime/step_cpu.py --family gpt2 --plans tp2 pp2-zero3 --profile /tmp/prof

The model is the sweep's (``tiny_config`` of a transformers family through the table adapter, hidden 64, 4 layers,
16 tokens, global batch 8, 2 micro-batches, 4 forked gloo ranks), the plans are the sweep's
(``packages/galva-models/tests/test_tables.py``). A step is ``galva_hp.train_step``; the figure is
``time.process_time`` (user + sys of the rank, less sensitive to the machine's load than wall time) per step, the
median over the measured steps after ``--warmup`` steps, the mean over the ranks. ``--profile DIR`` writes rank 0's
cProfile of the measured steps of each plan to ``DIR/<plan>.prof`` and prints its top functions.

To compare two source trees, run this script with ``PYTHONPATH`` pointing at each tree's ``packages/*/src`` in turn,
back to back on the same machine, and compare the ratios.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import pstats
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _sweep_plans():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("_sweep", ROOT / "packages/galva-models/tests/test_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(rank: int, world_size: int, family: str, plans: list[str], steps: int, warmup: int, profile: str | None):
    import torch

    from galva_hp import BuildOptions, GalvaOptimizer, build, train_step
    from galva_hp.testing.oracle import OPTIM, SEQ, batch
    from galva_models.tables import ADAPTER

    sweep = _sweep_plans()
    ids, labels = batch()
    out = {}
    for plan in plans:
        torch.manual_seed(0)
        built = build(ADAPTER.decompose(ADAPTER.build_model(sweep._config(family))), sweep.PLANS[plan],
                      BuildOptions(seq_len=SEQ))  # fmt: skip
        optimizer = GalvaOptimizer(built.param_records(), OPTIM)
        times, threads, spent = [], [], [0.0]
        _time_optimizer(optimizer, spent)
        profiler = cProfile.Profile(time.thread_time) if profile and rank == 0 else None
        for step in range(warmup + steps):
            k = step % ids.shape[0]
            if step == warmup:
                spent[0] = 0.0
                if profiler is not None:
                    profiler.enable()
            start, main = time.process_time(), time.thread_time()
            train_step(built, optimizer, ids[k], labels[k])
            if step >= warmup:
                times.append(time.process_time() - start)
                threads.append(time.thread_time() - main)
        if profiler is not None:
            profiler.disable()
            assert profile is not None
            Path(profile).mkdir(parents=True, exist_ok=True)
            profiler.dump_stats(f"{profile}/{plan}.prof")
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            out[f"{plan}/profile"] = text.getvalue()
        out[plan] = statistics.median(times)
        out[f"{plan}/main"] = statistics.median(threads)
        out[f"{plan}/optimizer"] = spent[0] / steps
    return out


def _time_optimizer(optimizer, spent: list[float]) -> None:  # type: ignore[no-untyped-def]
    """Add the main thread's CPU time in ``optimizer``'s clipping and step to ``spent[0]``."""
    for name in ("clip_grad_norm", "step"):
        original = getattr(optimizer, name)

        def timed(original=original):  # type: ignore[no-untyped-def]
            start = time.thread_time()
            result = original()
            spent[0] += time.thread_time() - start
            return result

        setattr(optimizer, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama")
    parser.add_argument("--plans", nargs="*", default=["tp2", "tp2-megatron_sp", "ulysses2", "pp2-zero3", "pp2-mixed"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", default=None, help="directory for rank 0's cProfile of each plan")
    args = parser.parse_args()
    from galva_comm.testing import run_distributed

    sweep = _sweep_plans()
    sweep._constraints(sweep._config(args.family))  # the family's probe, inherited by the forked ranks
    results = run_distributed(measure, 4, args.family, args.plans, args.steps, args.warmup, args.profile, timeout=900)
    for plan in args.plans:
        if f"{plan}/profile" in results[0]:
            print(results[0][f"{plan}/profile"])
    print(f"{'plan':<20} CPU-ms/step/rank: process, main thread, its clip + optimizer step (mean over the ranks)")
    for plan in args.plans:
        process, main, optim = (1e3 * statistics.mean(r[key] for r in results)
                                for key in (plan, f"{plan}/main", f"{plan}/optimizer"))  # fmt: skip
        print(f"{plan:<20} {process:8.1f} {main:8.1f} {optim:8.1f}")


if __name__ == "__main__":
    main()
