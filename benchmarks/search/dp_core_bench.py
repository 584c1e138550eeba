"""DP core against DP core: replay the per-stage problems Galvatron's search solved, with Galva's solver.

galvatron_driver.py saves the inputs and results of Galvatron's DPAlg calls (memory already rounded up to whole MiB by
Galvatron, budget = max_mem - other_mem[k] per vocab degree k). This script solves the same problems with
galva_search.dp, checks that the optimal times agree (to 1e-9 relative) and that infeasibility agrees, and reports
Galva's core time next to the reference core time measured in the driver (same machine).

    .venv/bin/python benchmarks/search/dp_core_bench.py CAPTURE_DIR [--threads N]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time

import numpy as np

from galva_search import dp


def load(path: str) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def replay(capture_dir: str, threads: int) -> dict:
    files = sorted(glob.glob(os.path.join(capture_dir, "dp_*.npz")))
    problems, expected = [], []
    reference_s = 0.0
    for f in files:
        c = load(f)
        reference_s += float(c["seconds"])
        for k, other_mem, other_time, total, remaining in zip(
            c["k"], c["other_mem"], c["other_time"], c["total_cost"], c["remaining"]
        ):
            budget = float(c["max_mem"]) - float(other_mem)
            problems.append(dp.StageProblem(c["intra"], c["memory"].astype(np.float64), c["inter"], budget))
            expected.append((float(total) - float(other_time) if remaining >= 0 else None, int(k)))
    t0 = time.perf_counter()
    serial = [
        dp.solve_stage(p.intra_time, p.memory_mib, p.inter_time, p.budget_mib) for p in problems
    ]
    serial_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    parallel = dp.solve_many(problems, threads=threads)
    parallel_s = time.perf_counter() - t0
    mismatches = 0
    for got, got_p, (want, _) in zip(serial, parallel, expected):
        differs = got != got_p or (got is None) != (want is None)
        if differs or (got is not None and abs(got.time - want) > 1e-9 * max(1.0, abs(want))):
            mismatches += 1
    methods: dict[str, int] = {}
    for p in problems[:: max(1, len(problems) // 200)]:
        st: dict = {}
        dp.solve_stage(p.intra_time, p.memory_mib, p.inter_time, p.budget_mib, stats=st)
        methods[st["method"]] = methods.get(st["method"], 0) + 1
    return {
        "dp_calls": len(files),
        "stage_problems": len(problems),
        "reference_core_s": reference_s,
        "galva_serial_s": serial_s,
        "galva_solve_many_s": parallel_s,
        "mismatches": mismatches,
        "methods_sampled": methods,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture_dir")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(replay(a.capture_dir, a.threads), indent=1))


if __name__ == "__main__":
    main()
