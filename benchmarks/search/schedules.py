"""Pipeline schedules in Galva's search: which schedule wins, by how much over the best 1F1B plan, at what search time.

    .venv/bin/python benchmarks/search/schedules.py [--repeat 3] [--write-readme]

Per case, three searches on the same inputs: 1F1B only (the reference's schedule), every schedule the search can
choose (``--pipeline-schedule auto``: 1F1B, interleaved 1F1B with 2 or 4 model chunks per stage, zb-h1), and one
search per schedule alone (to show each schedule's best plan). Search times are the median of ``--repeat`` runs of
``galva_search.search.search`` (cost tables built inside it; the profiles read once, outside). Every plan is scored by
Galva's cost model (docs/cost-model.md), the only judge here: the runtime has not measured these schedules yet.

Inputs:
* ``examples/llama-7b-8gpu``: the shipped Galva profiles (LLaMA-7B on one 8-GPU node), the example's own search
  (36 GB, batch 64, tp+sp) and tighter budgets.
* The benchmark cases of ``run.py``/``README.md`` (Galvatron's shipped LLaMA-7B profiles, the 8x8 cluster extrapolated
  from its 2-node files): read from ``benchmarks/search/.work/``, which ``run.py`` prepares (run it once first).

Results go to ``.work/schedules.json`` and, with ``--write-readme``, into README.md between the schedule markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORK = os.path.join(HERE, ".work")
README = os.path.join(HERE, "README.md")
BEGIN, END = "<!-- schedules:begin -->", "<!-- schedules:end -->"
MODEL_NAME = "hidden4096_head32_seqlen2048"


@dataclass(frozen=True)
class Case:
    name: str
    source: str  # "example" (examples/llama-7b-8gpu) or "work" (run.py's prepared Galvatron inputs)
    nodes: int
    memory_mib: float
    batch_sizes: tuple[int, ...]
    micro_batches: int | None = None  # fixed micro-batch count, None: every count
    layers: int = 32
    reserve_mib: float | None = None  # None: Galva's default 5%
    sp_space: str = "tp"
    default_dp_type: str = "zero2"


def _reference_reserve(memory_gb: int) -> float:
    """Galvatron's 20% cache above 20 GB (run.py's setting, so that the plans match its table)."""
    budget = memory_gb * 1024
    return float(int(budget * 0.2)) if budget // 1024 > 20 else 0.0


CASES = [
    Case("example-llama7b-1x8-36GB", "example", 1, 36e9 / 2**20, (64,), sp_space="tp+sp", default_dp_type="ddp"),
    Case("example-llama7b-1x8-24GB", "example", 1, 24e9 / 2**20, (64,), sp_space="tp+sp", default_dp_type="ddp"),
    Case("llama7b-1x8-24GB", "work", 1, 24 * 1024.0, (32,), reserve_mib=_reference_reserve(24)),
    Case("llama7b-1x8-36GB", "work", 1, 36 * 1024.0, (32,), reserve_mib=_reference_reserve(36)),
    Case("llama7b-2x8-40GB", "work", 2, 40 * 1024.0, (64,), reserve_mib=_reference_reserve(40)),
    Case("llama80L-8x8-80GB", "work", 8, 80 * 1024.0, (128,), micro_batches=8, layers=80,
         reserve_mib=_reference_reserve(80)),
    Case("llama80L-8x8-80GB-wide", "work", 8, 80 * 1024.0, tuple(range(64, 1025, 64)), layers=80,
         reserve_mib=_reference_reserve(80)),
]


def load_inputs(case: Case):
    from galva_schema import HardwareProfile, ModelProfile
    from galva_schema.reference import read_galvatron_hardware, read_galvatron_model_profile

    if case.source == "example":
        base = os.path.join(ROOT, "examples", "llama-7b-8gpu")
        return HardwareProfile.load(os.path.join(base, "hardware.json")), ModelProfile.load(
            os.path.join(base, "model.json")
        )
    hw_dir = os.path.join(WORK, f"hardware-{case.nodes}x8")
    profiles = os.path.join(WORK, "profiles")
    if not os.path.isdir(hw_dir) or not os.path.isdir(profiles):
        raise SystemExit(f"{hw_dir} or {profiles} missing: run benchmarks/search/run.py once to prepare them")
    hardware = read_galvatron_hardware(hw_dir, num_nodes=case.nodes, gpus_per_node=8)
    model = read_galvatron_model_profile(
        os.path.join(profiles, f"computation_profiling_bf16_{MODEL_NAME}.json"),
        os.path.join(profiles, f"memory_profiling_bf16_{MODEL_NAME}.json"),
        model_name=MODEL_NAME, num_layers=[case.layers], hidden_sizes=[4096], seq_lengths=[2048],
        static_batch_size=1,  # the entry the reference's static mode reads (run.py, inputs.STATIC_BATCH)
    )
    return hardware, model


def plan_label(strategy) -> str:
    s = strategy
    sched = s.pipeline_schedule.value + (f"×{s.virtual_stages}" if s.virtual_stages > 1 else "")
    return f"bsz {s.global_batch_size}, pp{s.pp} {sched} c{s.num_micro_batches}, division {list(s.pp_division)}"


def run_case(case: Case, repeat: int) -> dict[str, Any]:
    from galva_schema import DataParallelType, PipelineSchedule, Precision
    from galva_search.cost_model import CostModel, CostSettings
    from galva_search.search import NoFeasibleStrategy, SearchOptions, search
    from galva_search.space import SpaceOptions

    hardware, model = load_inputs(case)
    dp_type = DataParallelType(case.default_dp_type)
    settings = CostSettings(precision=Precision.BF16, default_dp_type=dp_type)
    one, inter, zb = PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.ZB_H1
    variants = {
        "1f1b": (one,),
        "auto": (one, inter, zb),
        "interleaved-1f1b": (inter,),
        "zb-h1": (zb,),
    }
    out: dict[str, Any] = {"case": case.name, "searches": {}}
    for name, schedules in variants.items():
        times, cpu, result = [], [], None
        for _ in range(repeat if name in ("1f1b", "auto") else 1):
            cost = CostModel(hardware, model, settings)  # fresh caches every run
            options = SearchOptions(
                memory_budget_mib=case.memory_mib, memory_reserve_mib=case.reserve_mib, batch_sizes=case.batch_sizes,
                space=SpaceOptions(preset="full", sp_space=case.sp_space, default_dp_type=dp_type),
                num_micro_batches=case.micro_batches, schedules=schedules, virtual_stages=(2, 4),
            )
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                result = search(cost, options)
            except NoFeasibleStrategy:
                result = None
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        entry: dict[str, Any] = {
            "search_s": statistics.median(times), "runs_s": times, "cpu_s": statistics.median(cpu), "runs_cpu_s": cpu,
        }
        if result is not None:
            entry.update(
                throughput=result.summary.throughput_samples_per_s,
                iteration_time_s=result.summary.iteration_time_s,
                plan=plan_label(result.strategy),
                schedule=result.strategy.pipeline_schedule.value,
                virtual_stages=result.strategy.virtual_stages,
                tasks=result.summary.counts.tasks,
                solved=result.summary.counts.solved,
            )
        out["searches"][name] = entry
        print(f"{case.name:28s} {name:17s} {entry.get('plan', 'infeasible')}  "
              f"{entry.get('throughput', 0.0):.3f}/s  search {entry['search_s']:.3f} s", flush=True)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | best 1F1B plan, samples/s | search 1F1B only: wall / CPU (s) | winner (all schedules) | samples/s "
        "| gain over best 1F1B | search all schedules: wall / CPU (s) | best interleaved / zb-h1 alone, samples/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s = row["searches"]
        base, auto = s["1f1b"], s["auto"]
        if "throughput" not in auto:
            continue
        winner = auto["schedule"] + (f" ×{auto['virtual_stages']}" if auto["virtual_stages"] > 1 else "")
        gain = f"{(auto['throughput'] / base['throughput'] - 1) * 100:+.1f}%" if "throughput" in base else "-"
        alone = " / ".join(f"{s[k]['throughput']:.3f}" if "throughput" in s[k] else "-"
                           for k in ("interleaved-1f1b", "zb-h1"))
        lines.append(
            f"| {row['case']} | {base.get('throughput', float('nan')):.3f} | {base['search_s']:.3f} / "
            f"{base['cpu_s']:.3f} | {winner} | {auto['throughput']:.3f} | {gain} | {auto['search_s']:.3f} / "
            f"{auto['cpu_s']:.3f} | {alone} |"
        )
    lines.append("")
    lines.append("Plans (1F1B only → all schedules):")
    for row in rows:
        s = row["searches"]
        lines.append(f"- {row['case']}: `{s['1f1b'].get('plan', 'infeasible')}` → `{s['auto'].get('plan', '-')}`")
    return "\n".join(lines)


def write_readme(rows: list[dict[str, Any]], command: str, repeat: int) -> None:
    with open(README) as f:
        text = f.read()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    body = (
        f"{BEGIN}\nProduced by `{command}` on {platform.machine()} ({os.cpu_count()} CPUs), {stamp}; search times are "
        f"the median of {repeat} runs.\n\n{table(rows)}\n{END}"
    )
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + body + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n## Pipeline schedules (schedules.py)\n\n" + body + "\n"
    with open(README, "w") as f:
        f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per timed search (median)")
    parser.add_argument("--write-readme", action="store_true")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    rows = [run_case(case, args.repeat) for case in cases]
    os.makedirs(WORK, exist_ok=True)
    with open(os.path.join(WORK, "schedules.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(table(rows))
    if args.write_readme:
        command = ".venv/bin/python benchmarks/search/schedules.py --write-readme" + (
            f" --repeat {args.repeat}" if args.repeat != 3 else ""
        )
        write_readme(rows, command, args.repeat)


if __name__ == "__main__":
    sys.exit(main())
