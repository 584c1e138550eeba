"""Where a `galva run` plan's step goes, per rank and per op, beside the cost model's breakdown of the same plan.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime/trace_run.py galva-run --plans 4x4 2x2 --steps 6

``galva-run`` is a `galva run` output directory (its ``model/``, ``profiles/`` and ``strategy.json``). Each ``PPxC``
is that strategy with ``pp`` stages (even division) and ``c`` micro-batches, the rest unchanged (dp fills the world).
The plans run in the same forked gloo ranks (``--nproc``, default the run's world), step by step in turn on a random
batch of the run's shapes; after ``--warmup`` steps each further step is traced with ``schedule_trace`` (the executor's
F, B, p2p receives and sends, the gradient sync, clip and optimizer: wall and thread CPU time). Printed per plan: the
median step, per rank ms per kind of op (CPU in brackets), the receives' waiting, and galva-search's prediction and
breakdown (``evaluate_strategy`` on the run's profiles).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from pathlib import Path

import schedule_trace  # same directory
import torch
import torch.distributed as dist

from galva_comm.testing import run_distributed
from galva_schema import Strategy


def variant(base: Strategy, pp: int, c: int) -> Strategy:
    """``base`` with ``pp`` even stages and ``c`` micro-batches."""
    data = base.to_dict()
    n = base.num_layers
    data.update(pp=pp, pp_division=[n // pp + (1 if s < n % pp else 0) for s in range(pp)], num_micro_batches=c)
    return Strategy.from_dict(data)


def _ranks(rank: int, world: int, run: str, plans: list[str], steps: int, warmup: int) -> dict:
    from transformers import AutoConfig

    from galva_hp import BuildOptions, GalvaOptimizer, OptimConfig, build, train_step
    from galva_models.tables import ADAPTER

    config = AutoConfig.from_pretrained(f"{run}/model")
    base = Strategy.load(f"{run}/strategy.json")
    seq = config.max_position_embeddings
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (base.global_batch_size, seq))
    labels = torch.roll(ids, -1, 1)
    runs = {}
    for plan in plans:
        pp, c = map(int, plan.split("x"))
        torch.manual_seed(0)
        model = build(ADAPTER.decompose(ADAPTER.build_model(config)), variant(base, pp, c), BuildOptions(seq_len=seq))
        optimizer = GalvaOptimizer(model.param_records(), OptimConfig(lr=1e-4, max_grad_norm=1.0))
        runs[plan] = lambda m=model, o=optimizer: train_step(m, o, ids, labels)
    schedule_trace.install()
    out: dict[str, list] = {plan: [] for plan in plans}
    for step in range(warmup + steps):
        for plan, run_step in runs.items():
            dist.barrier()
            schedule_trace.take()
            start, cpu = time.perf_counter(), time.process_time()
            run_step()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            events = schedule_trace.take()
            if step >= warmup:
                out[plan].append((start, wall, cpu, events))
    return out


def _predicted(run: str, plan: str) -> str:
    from galva_schema import HardwareProfile, ModelProfile
    from galva_search.cost_model import CostModel, CostSettings
    from galva_search.evaluation import evaluate_strategy

    profiles = Path(run) / "profiles"
    cost = CostModel(
        HardwareProfile.load(profiles / "hardware.json"), ModelProfile.load(profiles / "model.json"), CostSettings()
    )
    pp, c = map(int, plan.split("x"))
    ev = evaluate_strategy(cost, variant(Strategy.load(f"{run}/strategy.json"), pp, c))
    detail = ev.detail
    assert detail is not None
    parts = " ".join(f"{k} {1e3 * v:.1f}" for k, v in detail.time_breakdown_s(c).items())
    stages = " ".join(f"{1e3 * u:.1f}" for u in detail.stage_time_s)
    return f"predicted {1e3 * ev.iteration_time_s:.1f} ms ({parts}; U per stage {stages})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a galva run output directory")
    parser.add_argument("--plans", nargs="+", default=["4x4", "2x2"], metavar="PPxC")
    parser.add_argument("--nproc", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--save", help="write the ranks' events to this file (pickle)")
    parser.add_argument("--load", help="print the events --save wrote instead of running")
    args = parser.parse_args()
    run = str(Path(args.run).resolve())
    world = args.nproc or Strategy.load(f"{run}/strategy.json").world_size
    if args.load:
        ranks = pickle.loads(Path(args.load).read_bytes())
    else:
        ranks = run_distributed(_ranks, world, run, args.plans, args.steps, args.warmup, timeout=1200)
        if args.save:
            Path(args.save).write_bytes(pickle.dumps(ranks))
    for plan in args.plans:
        walls = [statistics.median(w for _, w, _, _ in r[plan]) for r in ranks]
        cpus = [statistics.median(c for _, _, c, _ in r[plan]) for r in ranks]
        print(f"== {plan}: step {1e3 * max(walls):.1f} ms wall; process CPU per rank "
              + " ".join(f"{1e3 * c:.1f}" for c in cpus) + f"; {_predicted(run, plan)}")  # fmt: skip
        for rank, r in enumerate(ranks):
            rows = [schedule_trace.summary(ev, start, wall) for start, wall, _, ev in r[plan]]
            keys = sorted({k for row in rows for k in row if not k.endswith((" cpu", " n"))})
            cells = []
            for k in keys:
                wall = statistics.median(row.get(k, 0.0) for row in rows)
                cpu = statistics.median(row.get(f"{k} cpu", 0.0) for row in rows)
                n = statistics.median(row.get(f"{k} n", 0.0) for row in rows)
                cells.append(f"{k} {wall:.1f}" + (f" ({cpu:.1f}, n {n:.0f})" if n else ""))
            print(f"  rank {rank}: " + "; ".join(cells))
        delays = [d for step in range(args.steps)
                  for d in schedule_trace.message_delays([r[plan][step][3] for r in ranks])]  # fmt: skip
        if delays:
            print(f"  {len(delays) / args.steps:.0f} messages a step reach a waiting receiver: delay median "
                  f"{1e3 * statistics.median(delays):.2f} ms, mean {1e3 * statistics.mean(delays):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
