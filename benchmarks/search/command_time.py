"""The whole ``galva-search`` command as a user runs it, timed side by side for source trees (CPU = user + sys of
the process and its threads, and wall), each run a fresh process, trees interleaved; says whether the plans and
predicted times of the trees are identical.

    .venv/bin/python benchmarks/search/mixtral_ep.py --write-profiles /tmp/mixtral     # the Mixtral profiles
    .venv/bin/python benchmarks/search/command_time.py --runs 3 --mixtral /tmp/mixtral TREE [TREE ...]

A TREE is a checkout (its ``packages/*/src`` come first on the path, the venv's editable redirect of galva_search is
bypassed, so each tree needs its compiled core: copy ``_core*.so`` into its ``galva_search``). Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LC = ROOT / "examples" / "llama-7b-64gpu-long-context"
LONG = ["--memory", "80GB", "--global-batch-size", "16", "--sp-space", "tp+sp", "--max-cp", "8"]
RUN = """import glob, sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
sys.path[:0] = sorted(glob.glob(sys.argv[1] + "/packages/*/src"))
sys.argv = ["galva-search", *sys.argv[2:]]
from galva_search.cli import main
sys.exit(main())
"""


def cases(mixtral: Path | None) -> dict[str, list[str]]:
    out = {
        "start-up (--help)": ["--help"],
        "LLaMA-7B 32k, --max-cp 8": ["--hardware-profile", f"{LC}/hardware.json", "--model-profile",
                                     f"{LC}/model-32k.json", *LONG],
        "LLaMA-7B 128k, --max-cp 8": ["--hardware-profile", f"{LC}/hardware.json", "--model-profile",
                                      f"{LC}/model-128k.json", *LONG],
    }  # fmt: skip
    if mixtral is not None:  # mixtral_ep.py --write-profiles prints this command
        out["Mixtral-8x7B per layer, 80 GiB"] = [
            "--hardware-profile", f"{mixtral}/hardware.json", "--model-profile", f"{mixtral}/model.json",
            "--memory", "80GiB", "--global-batch-size", "256", "--num-micro-batches", "8", "--default-dp-type", "zero2",
            "--context-memory", "1024MiB",
        ]  # fmt: skip
    return out


def run_once(tree: str, args: list[str], out: Path) -> tuple[float, float, tuple[str, float] | None]:
    searching = args != ["--help"]
    extra = ["--quiet", "--output", str(out), "--summary-json", f"{out}.summary"] if searching else []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", RUN, tree, *args, *extra], capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: galva-search failed: {done.stderr.strip()}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if not searching:
        return cpu, wall, None
    return cpu, wall, (out.read_text(), json.loads(Path(f"{out}.summary").read_text())["iteration_time_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mixtral", type=Path, help="directory written by mixtral_ep.py --write-profiles")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in cases(args.mixtral).items():
            times: dict[str, list[tuple[float, float]]] = {t: [] for t in args.trees}
            results = {}
            for _ in range(args.runs):
                for k, tree in enumerate(args.trees):
                    cpu, wall, result = run_once(tree, argv, Path(tmp) / f"plan-{k}.json")
                    times[tree].append((cpu, wall))
                    results[tree] = result
            for tree, rows in times.items():
                cpu = statistics.median(r[0] for r in rows)
                wall = statistics.median(r[1] for r in rows)
                print(f"{name}: {tree}: CPU {cpu:.2f} s, wall {wall:.2f} s (median of {args.runs})")
            if None not in results.values():
                same = len({r for r in results.values()}) == 1
                print(f"{name}: plans and predicted times identical: {same}")


if __name__ == "__main__":
    main()
