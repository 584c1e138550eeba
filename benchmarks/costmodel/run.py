#!/usr/bin/env python3
"""Cost model against the runtime on this machine's CPU ranks (issue #9 part 5).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/costmodel/run.py      # profiles, then `galva-profile check`

Profiles tiny-llama (fp32, seq 32, one thread per rank) and the 2- and 4-rank gloo hardware, writes the strategies
below, runs `galva-profile check` on each world and leaves `.work/check{2,4}.json`, `.work/table{2,4}.md` and the
calibrations. Not part of the test suite.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

from galva_schema import LayerStrategy, Strategy

HERE = Path(__file__).resolve().parent
WORK = HERE / ".work"
PROFILE = [sys.executable, "-m", "galva_profiler.cli"]
HW = ["--quick", "--repetitions", "7", "--quiet"]  # 7 repetitions: medians robust to a shared box


def plan(world: int, layers: list[dict], pp: int = 1, c: int = 1, **kw: object) -> Strategy:
    division = [4] if pp == 1 else [2, 2]
    return Strategy(world_size=world, pp=pp, pp_division=division, global_batch_size=8, num_micro_batches=c,
                    mixed_precision="fp32", layers=[LayerStrategy(**layer) for layer in layers], **kw)


def strategies(world: int) -> dict[str, Strategy]:
    t = 2
    out = {
        "dp": plan(world, [{"tp": 1}] * 4),
        "zero2-c2": plan(world, [{"tp": 1, "dp_type": "zero2"}] * 4, c=2),
        "zero3": plan(world, [{"tp": 1, "dp_type": "zero3"}] * 4),
        "tp2": plan(world, [{"tp": t}] * 4),
        "tp2-megatron-sp": plan(world, [{"tp": t}] * 4, megatron_sp=True),
        "ulysses2": plan(world, [{"tp": t, "ulysses": True}] * 4),
        "tp2-ckpt": plan(world, [{"tp": t, "checkpoint": True}] * 4),
        "pp2-1f1b-c4": plan(world, [{"tp": 1}] * 4, pp=2, c=4),
        "pp2-gpipe-c4": plan(world, [{"tp": 1}] * 4, pp=2, c=4, pipeline_schedule="gpipe"),
        "mixed": plan(world, [{"tp": 1, "dp_type": "zero3"}, {"tp": t, "checkpoint": True}, {"tp": t},
                              {"tp": 1, "checkpoint": True}]),
    }
    return out


def ranking(report_path: Path) -> str:
    """Plan ranking: over the pairs of strategies whose times differ by more than the measured noise (half the range
    of the timed steps of each, summed) both predicted and measured, how often the faster-predicted one is faster."""
    report = json.loads(report_path.read_text())
    predicted = {r["strategy"]: r["predicted_time_s"] for r in report["rows"]}
    items = [(s["name"], predicted[s["name"]], s["measured_time_s"], s["time_spread_s"]) for s in report["strategies"]]
    clear, right, wrong = 0, 0, []
    for (a, pa, ma, na), (b, pb, mb, nb) in itertools.combinations(items, 2):
        noise = na + nb
        if abs(pa - pb) > noise and abs(ma - mb) > noise:
            clear += 1
            if (pa < pb) == (ma < mb):
                right += 1
            else:
                wrong.append(f"{a}/{b}")
    pairs = len(items) * (len(items) - 1) // 2
    return f"{clear} of {pairs} pairs clear of the noise, {right} ranked right; wrong: {', '.join(wrong) or 'none'}"


def run(args: list[str]) -> None:
    result = subprocess.run(args, cwd=WORK, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(result.stderr[-3000:])


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    WORK.mkdir(exist_ok=True)
    run([*PROFILE, "model", "--preset", "tiny-llama", "--seq-lengths", "32", "--batch-sizes", "1,2,4,8",
         "--max-tp", "4", "--quiet", "-o", "model.json", "--report", "model_report.json"])
    for world in (2, 4):
        run([*PROFILE, "hardware", "--nproc-per-node", str(world), *HW, "-o", f"hw{world}.json"])
        directory = WORK / f"plans{world}"
        directory.mkdir(exist_ok=True)
        for name, strategy in strategies(world).items():
            strategy.save(directory / f"{name}.json")
        run([*PROFILE, "check", "--hardware-profile", f"hw{world}.json", "--model-profile", "model.json",
             "--preset", "tiny-llama", "--strategy", str(directory), "--steps", "5", "--warmup", "2",
             "-o", f"check{world}.json", "--table", f"table{world}.md", "--calibration-output", f"cal{world}.json"])
        print((WORK / f"table{world}.md").read_text())
        print(f"plan ranking, {world} ranks:", ranking(WORK / f"check{world}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
