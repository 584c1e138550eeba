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
import statistics
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


def ranking(*report_paths: Path) -> tuple[str, str]:
    """Plan ranking (issue #9): for every pair of strategies whose PREDICTED times differ by more than the measured
    noise (half the range of the timed steps of each, summed over the pair), is the faster-predicted one faster
    measured? Returns the one-line summary and the Markdown table of every pair (clear of the noise or not)."""
    items: list[tuple[str, float, float, float]] = []
    for path in report_paths:
        report = json.loads(path.read_text())
        predicted = {r["strategy"]: r["predicted_time_s"] for r in report["rows"]}
        items += [(s["name"], predicted[s["name"]], s["measured_time_s"], s["time_spread_s"])
                  for s in report["strategies"]]
    lines = ["| pair (A / B) | predicted A / B (ms) | measured A / B (ms) | noise (ms) | predicted gap > noise | "
             "measured gap > noise | faster-predicted is faster measured |", "|---|---|---|---|---|---|---|"]
    clear = right = both = both_right = 0
    wrong: list[str] = []
    for (a, pa, ma, na), (b, pb, mb, nb) in itertools.combinations(items, 2):
        noise = na + nb
        pred_clear, meas_clear = abs(pa - pb) > noise, abs(ma - mb) > noise
        agree = (pa < pb) == (ma < mb)
        if pred_clear:
            clear += 1
            right += agree
            if not agree:
                wrong.append(f"{a}/{b}{'' if meas_clear else ' (measured within noise)'}")
            if meas_clear:
                both += 1
                both_right += agree
        verdict = ("agree" if agree else "**disagree**") if pred_clear else "—"
        lines.append(f"| {a} / {b} | {1e3 * pa:.1f} / {1e3 * pb:.1f} | {1e3 * ma:.1f} / {1e3 * mb:.1f} | "
                     f"{1e3 * noise:.1f} | {'yes' if pred_clear else 'no'} | {'yes' if meas_clear else 'no'} | "
                     f"{verdict} |")
    pairs = len(items) * (len(items) - 1) // 2
    summary = (f"{clear} of {pairs} pairs differ in prediction by more than the measured noise; in {right} of them "
               f"the faster-predicted strategy is faster measured ({both} also clear of the noise in measurement, "
               f"{both_right} of those right); wrong: {', '.join(wrong) or 'none'}")
    return summary, "\n".join(lines)


def reprice(world: int, model: Path, call_extra: bool = True, work: Path = WORK) -> str:
    """The last run's measured times (``.work/check{world}.json``, and galva-search's own plans in
    ``check{world}-top.json``) against the cost model as it is now, on
    ``model`` and ``.work/hw{world}.json``: what a change of the cost model or of one profile does, with the
    measurements held fixed; ``call_extra=False`` prices every collective call at its idle curve (the hardware
    profile's busy-call term left out). One line per strategy and the median / max |time error| over them."""
    from galva_profiler.check import CheckOptions, predict
    from galva_schema import HardwareProfile, ModelProfile, Strategy

    hardware, profile = HardwareProfile.load(work / f"hw{world}.json"), ModelProfile.load(model)
    if not call_extra:
        hardware = hardware.model_copy(update={"call_extra": ()})
    lines, errors = [], []
    checks = [work / f"check{world}.json", work / f"check{world}-top.json"]
    for measured in (m for path in checks if path.exists() for m in json.loads(path.read_text())["strategies"]):
        strategy = Strategy.from_dict(measured["strategy"])
        evaluation = predict(hardware, profile, strategy, CheckOptions())
        error = evaluation.iteration_time_s / measured["measured_time_s"] - 1
        errors.append(abs(error))
        parts = evaluation.detail.time_breakdown_s(strategy.num_micro_batches)
        lines.append(f"{world} {measured['name']:16s} {1e3 * evaluation.iteration_time_s:7.1f} / "
                     f"{1e3 * measured['measured_time_s']:7.1f} ms {error:+7.1%} | "
                     + " ".join(f"{k} {1e3 * v:.1f}" for k, v in parts.items()))
    errors.sort()
    median = (errors[len(errors) // 2] + errors[(len(errors) - 1) // 2]) / 2
    return "\n".join([*lines, f"{world} ranks: median |time error| {median:.1%}, max {errors[-1]:.1%} (per strategy)"])


def run(args: list[str], work: Path, *, fatal: bool = True) -> bool:
    result = subprocess.run(args, cwd=work, capture_output=True, text=True)
    if result.returncode != 0:
        if fatal:
            sys.exit(result.stderr[-3000:])
        print(result.stderr[-1500:], file=sys.stderr)
    return result.returncode == 0


TOP = 3  # also run the TOP fastest plans galva-search ranks on the same profiles (`check --top`)


def steps_ms(strategy: dict) -> list[float]:
    """A measured strategy's per-step times (the slowest rank's forward-backward and optimizer step), ms."""
    ranks = strategy["ranks"]
    steps = range(len(ranks[0]["forward_backward_ms"]))
    return [max(r["forward_backward_ms"][i] + r["optimizer_ms"][i] for r in ranks) for i in steps]


def pooled(world: int, rounds: list[Path], top: bool = False) -> str:
    """Every round's checks of ``world`` ranks together: per strategy the median of the rounds' predictions (each on
    its round's profiles) against the median of all their timed steps, and the median / max |time error|; beside it
    each round's own error. The box's drift moves both sides from minute to minute (a layer's CPU time by +-25%); the
    rounds sample it over the whole benchmark, and a median on both sides keeps one round's slow profile (one 4-rank
    hardware profile priced every tp form 25% above the other rounds') from moving the figure. ``top``: galva-search's
    own plans (``check{world}-top.json``), pooled where two rounds chose the same plan (its description, which carries
    the prediction, left out)."""
    by_name: dict[str, tuple[list[float], list[float], list[float]]] = {}
    for work in rounds:
        path = work / (f"check{world}-top.json" if top else f"check{world}.json")
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        predicted = {r["strategy"]: r["predicted_time_s"] * 1e3 for r in report["rows"]}
        for strategy in report["strategies"]:
            name = strategy["name"]
            if top:
                plan = {k: v for k, v in strategy["strategy"].items() if k != "description"}
                vocab = plan.get("vocab") or {}
                vocab_form = ", ".join(f"vocab {k} {v}" for k, v in vocab.items() if v not in (None, False, 1))
                name = f"{name[len('galva-search-'):]}: {Strategy.from_dict(plan).describe()}" + (
                    f", {vocab_form}" if vocab_form else "")
            preds, steps, errors = by_name.setdefault(name, ([], [], []))
            preds.append(predicted[strategy["name"]])
            steps.extend(steps_ms(strategy))
            errors.append(predicted[strategy["name"]] / strategy["measured_time_s"] / 1e3 - 1)
    if not by_name:
        return f"{world} ranks: no galva-search plans were checked"
    lines, errors = [], []
    for name, (preds, steps, own) in by_name.items():
        error = statistics.median(preds) / statistics.median(steps) - 1
        errors.append(abs(error))
        lines.append(f"{world} {name:18s} {statistics.median(preds):7.1f} / {statistics.median(steps):7.1f} ms "
                     f"{error:+7.1%} | rounds: " + " ".join(f"{e:+.1%}" for e in own))
    what = "galva-search's own plans" if top else f"{len(rounds)} rounds pooled"
    return "\n".join([*lines, f"{world} ranks, {what}: median |time error| "
                       f"{statistics.median(errors):.1%}, max {max(errors):.1%}"])


def one_round(work: Path, reuse_profiles: bool) -> None:
    """Profiles (unless reused) and the checks of both worlds in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    if not reuse_profiles:
        run([*PROFILE, "model", "--preset", "tiny-llama", "--seq-lengths", "32", "--batch-sizes", "1,2,4,8",
             "--max-tp", "4", "--repetitions", "15", "--quiet", "-o", "model.json", "--report", "model_report.json"],
            work)
    for world in (2, 4):
        if not reuse_profiles:
            run([*PROFILE, "hardware", "--nproc-per-node", str(world), *HW, "-o", f"hw{world}.json"], work)
        directory = work / f"plans{world}"
        directory.mkdir(exist_ok=True)
        for name, strategy in strategies(world).items():
            strategy.save(directory / f"{name}.json")
        common = ["--hardware-profile", f"hw{world}.json", "--model-profile", "model.json",
                  "--preset", "tiny-llama", "--steps", "15", "--warmup", "2", "--timing-span", "3"]
        run([*PROFILE, "check", *common, "--strategy", str(directory), "-o", f"check{world}.json",
             "--table", f"table{world}.md", "--calibration-output", f"cal{world}.json"], work)
        # galva-search's own ranking, trained for real: its TOP plans at global batch 8, 4 GiB per rank
        run([*PROFILE, "check", *common, "--top", str(TOP), "--memory", "4GiB", "--global-batch-size", "8",
             "-o", f"check{world}-top.json", "--table", f"table{world}-top.md"], work, fatal=False)


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4,
                    help="profile and check this many times in turn, each in .work/round<i>/ (default 4), then pool")
    ap.add_argument("--ranking-only", action="store_true", help="only print the summaries from .work/round*/")
    ap.add_argument("--reprice", type=Path, metavar="MODEL_JSON",
                    help="only re-predict the measured times of a round's check{2,4}.json on this model profile and "
                    "that round's hw{2,4}.json with the current cost model (nothing is run)")
    ap.add_argument("--round", type=int, default=1, help="with --reprice: the round (default 1)")
    ap.add_argument("--without-call-extra", action="store_true",
                    help="with --reprice: leave the hardware profile's call_extra out (every call at its idle curve)")
    ap.add_argument("--reuse-profiles", action="store_true",
                    help="keep each round's model.json and hw{2,4}.json from an earlier run (re-run the checks only)")
    opts = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if opts.reprice is not None:
        work = WORK / f"round{opts.round}"
        print("\n".join(reprice(world, opts.reprice.resolve(), not opts.without_call_extra, work) for world in (2, 4)))
        return 0
    rounds = [WORK / f"round{i + 1}" for i in range(opts.rounds)]
    for index, work in enumerate(rounds):
        if not opts.ranking_only:
            print(f"round {index + 1} of {len(rounds)} ...", file=sys.stderr, flush=True)
            one_round(work, opts.reuse_profiles)
    for world in (2, 4):
        for index, work in enumerate(rounds):
            print(f"## round {index + 1}, {world} ranks\n")
            print((work / f"table{world}.md").read_text())
            reports = [work / f"check{world}.json"]
            if (work / f"check{world}-top.json").exists():
                reports.append(work / f"check{world}-top.json")
                if (work / f"table{world}-top.md").exists():
                    print((work / f"table{world}-top.md").read_text())
            summary, pairs = ranking(*reports)
            (work / f"ranking{world}.md").write_text(pairs + "\n")
            print(f"plan ranking, round {index + 1}, {world} ranks: {summary}\n")
    print("\n".join(pooled(world, rounds) for world in (2, 4)))
    print("\n".join(pooled(world, rounds, top=True) for world in (2, 4)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
