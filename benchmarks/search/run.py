"""Galva's planner against PKU Galvatron's search engine, side by side on the same inputs.

    .venv/bin/python benchmarks/search/run.py [--cases NAME ...] [--reuse-reference] [--write-readme]

1. Creates benchmarks/search/.venv-galvatron (once) with torch==2.13.0 (CPU) installed FIRST under a constraints
   file, then numpy, scipy, tqdm and `hetu-galvatron==2.4.0 --no-deps` (its search imports once
   galvatron/core/__init__.py is bypassed, see galvatron_driver.py).
2. Prepares the inputs of both searches in benchmarks/search/.work/ (inputs.py): the LLaMA-7B profiles and the
   hardware files shipped with hetu-galvatron, the 8x8 hardware files extrapolated from the 2-node ones.
3. Per case: runs Galvatron's search (its own venv, a subprocess; wall time of initialize + parallelism_optimization,
   and the time of its DP calls), runs Galva's planner (in this venv), evaluates BOTH chosen strategies under BOTH
   cost models (Galva's evaluate_strategy here; Galvatron's own MemoryCostModel / pipeline_costmodel through
   galvatron_eval.py in its venv: per-stage memory against its budget, iteration time, per-layer time terms), and
   replays the first DP problems Galvatron solved through galva_search.dp (checking that the optima agree).
   Results go to .work/results.json and, with --write-readme, into README.md's tables.

Not part of the test suite: it takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import dp_core_bench  # noqa: E402
import inputs  # noqa: E402

VENV = os.path.join(HERE, ".venv-galvatron")
WORK = os.path.join(HERE, ".work")
VENV_PY = os.path.join(VENV, "bin", "python")
README = os.path.join(HERE, "README.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# Settings shared by both searches (Galvatron flag -> value); Galva's equivalents are set in run_galva().
COMMON = {
    "search_space": "full",
    "sp_space": "tp",
    "mixed_precision": "bf16",
    "default_dp_type": "zero2",
    "pipeline_type": "pipedream_flush",
}


@dataclass(frozen=True)
class Case:
    name: str
    nodes: int
    memory_gb: int
    layers: int
    batch_size: int
    micro_batches: int | None = None  # None: every micro-batch count (Galvatron's default), else fixed
    gpus_per_node: int = 8
    capture: int = 300  # Galvatron DP calls replayed through galva_search.dp


CASES = [
    Case("llama7b-1x8-24GB", 1, 24, 32, 32),
    Case("llama7b-1x8-36GB", 1, 36, 32, 32),
    Case("llama7b-1x8-80GB", 1, 80, 32, 32),
    Case("llama7b-2x8-40GB", 2, 40, 32, 64),
    Case("llama80L-8x8-80GB", 8, 80, 80, 128, micro_batches=8),
]


# Galva alone on searches too wide to run Galvatron on here: (case, batch sizes, micro-batch count or None = all).
WIDE = [
    ("llama80L-8x8-80GB", tuple(range(64, 1025, 64)), None),
    ("llama7b-2x8-40GB", tuple(range(16, 513, 16)), None),
]


@dataclass
class Row:
    case: str
    galvatron_s: float | None = None
    galvatron_dp_s: float | None = None
    galvatron_dp_calls: int | None = None
    galvatron_own_throughput: float | None = None
    galvatron_config: str | None = None
    galva_s: float | None = None
    galva_throughput: float | None = None
    galvatron_plan_throughput_in_galva: float | None = None
    galvatron_plan_memory_mib: list[float] | None = None
    galva_plan: str | None = None
    galvatron_plan: str | None = None
    core: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Galva's model, per stage, for both plans (MiB; breakdown from Evaluation.detail)
    galva_model: dict[str, Any] = field(default_factory=dict)
    # The reference's own cost model (galvatron_eval.py) for both plans, and what its engine read from the profiles
    reference_model: dict[str, Any] = field(default_factory=dict)
    reference_profile: dict[str, Any] = field(default_factory=dict)
    usable_mib: float | None = None


# ------------------------------------------------------------------------------------------------- environment
def ensure_galvatron_venv() -> None:
    if os.path.exists(VENV_PY) and _venv_ok():
        return
    print(f"creating {VENV} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    constraints = os.path.join(HERE, "galvatron-constraints.txt")
    pip = [VENV_PY, "-m", "pip", "install", "-q", "-c", constraints]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # first: otherwise pip picks a CUDA build
    subprocess.run([*pip, "numpy", "scipy", "tqdm"], check=True)
    subprocess.run([*pip, "--no-deps", "hetu-galvatron==2.4.0"], check=True)
    if not _venv_ok():
        raise SystemExit("the Galvatron venv does not import its search engine; see the pip output above")


def _venv_ok() -> bool:
    probe = "import galvatron_dp_core, scipy, torch, tqdm; print(torch.__version__)"
    r = subprocess.run([VENV_PY, "-c", probe], capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip().startswith("2.13.0")


def galvatron_dir() -> str:
    r = subprocess.run(
        [VENV_PY, "-c", "import galvatron, os; print(os.path.dirname(galvatron.__file__))"],
        capture_output=True, text=True, check=True,
    )
    return r.stdout.strip()


# ------------------------------------------------------------------------------------------------- one case
def case_dirs(case: Case) -> dict[str, str]:
    base = os.path.join(WORK, case.name)
    return {
        "base": base,
        "hardware": os.path.join(WORK, f"hardware-{case.nodes}x{case.gpus_per_node}"),
        "profiles": os.path.join(WORK, "profiles"),
        "out": os.path.join(base, "galvatron-out"),
        "logs": os.path.join(base, "galvatron-logs"),
        "capture": os.path.join(base, "dp-capture"),
    }


def run_galvatron(case: Case, timeout_s: int) -> dict[str, Any]:
    d = case_dirs(case)
    for key in ("out", "logs"):
        os.makedirs(d[key], exist_ok=True)
    if os.path.isdir(d["capture"]):
        for f in os.listdir(d["capture"]):
            os.remove(os.path.join(d["capture"], f))
    search = dict(COMMON, settle_bsz=case.batch_size)
    if case.micro_batches is not None:
        search["settle_chunk"] = case.micro_batches
    spec = {
        "num_nodes": case.nodes,
        "num_gpus_per_node": case.gpus_per_node,
        "memory_gb": case.memory_gb,
        "layers": case.layers,
        "hidden": inputs.HIDDEN,
        "seq": inputs.SEQ,
        "model_name": inputs.MODEL_NAME,
        "profile_dir": d["profiles"],
        "hardware_dir": d["hardware"],
        "output_dir": d["out"],
        "log_dir": d["logs"],
        "capture_dir": d["capture"],
        "capture_max": case.capture,
        "search": search,
    }
    spec_path = os.path.join(d["base"], "galvatron-case.json")
    out_path = os.path.join(d["base"], "galvatron-result.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=1)
    with open(os.path.join(d["base"], "galvatron-stdout.log"), "w") as log:
        subprocess.run(
            [VENV_PY, os.path.join(HERE, "galvatron_driver.py"), spec_path, out_path],
            stdout=log, stderr=subprocess.STDOUT, check=True, timeout=timeout_s,
        )
    with open(out_path) as f:
        return json.load(f)


def galva_inputs(case: Case):
    from galva_schema.reference import read_galvatron_hardware, read_galvatron_model_profile

    d = case_dirs(case)
    hardware = read_galvatron_hardware(d["hardware"], num_nodes=case.nodes, gpus_per_node=case.gpus_per_node)
    model = read_galvatron_model_profile(
        os.path.join(d["profiles"], f"computation_profiling_bf16_{inputs.MODEL_NAME}.json"),
        os.path.join(d["profiles"], f"memory_profiling_bf16_{inputs.MODEL_NAME}.json"),
        model_name=inputs.MODEL_NAME,
        num_layers=[case.layers],
        hidden_sizes=[inputs.HIDDEN],
        seq_lengths=[inputs.SEQ],
        # The reference's static mode reads the FIRST `layertype_0_*` / `layertype_other_*` key in file order
        # (spec §11.10): in the shipped file that is bsz 1 (6.281 / 5.786 ms per sample); galvatron_eval.py prints
        # what its engine read. Galva's reader would take the largest batch (bsz 14) unless told: same entry here.
        static_batch_size=inputs.STATIC_BATCH,
    )
    return hardware, model


def galva_cost_model(case: Case):
    from galva_schema import DataParallelType, PipelineSchedule, Precision
    from galva_search.cost_model import CostModel, CostSettings

    hardware, model = galva_inputs(case)
    settings = CostSettings(
        precision=Precision.BF16,
        pipeline_schedule=PipelineSchedule.ONE_F_ONE_B,  # Galvatron's pipedream_flush
        default_dp_type=DataParallelType.ZERO2,
        state_accounting=STATE_ACCOUNTING,
    )
    return CostModel(hardware, model, settings)


def galva_options(case: Case, batch_size: int | tuple[int, ...], micro_batches: int | None):
    """The planner's options equal to COMMON and the case (Galvatron's memory_constraint GB = GB * 1024 MiB)."""
    from galva_schema import DataParallelType
    from galva_search.search import SearchOptions
    from galva_search.space import SpaceOptions

    space = SpaceOptions(preset="full", sp_space="tp", default_dp_type=DataParallelType.ZERO2)
    return SearchOptions(
        memory_budget_mib=case.memory_gb * 1024.0,
        memory_reserve_mib=reference_reserve_mib(case) if RESERVE == "reference" else None,
        batch_sizes=batch_size if isinstance(batch_size, tuple) else (batch_size,),
        space=space,
        num_micro_batches=micro_batches,
    )


STATE_ACCOUNTING = "reference"  # --state-accounting: Galva's default bytes per parameter, or "galva-hp" (measured)
RESERVE = "reference"  # --galva-reserve: "reference" (the same usable memory as Galvatron) or "galva" (its 5%)


def reference_reserve_mib(case: Case) -> float:
    """Galvatron's "pytorch memory cache": int(20% of the constraint) when the constraint is above 20 GB, else 0."""
    budget = case.memory_gb * 1024
    return float(int(budget * 0.2)) if budget // 1024 > 20 else 0.0


def run_galva(case: Case) -> tuple[float, Any]:
    from galva_search.search import search

    t0 = time.perf_counter()
    cost = galva_cost_model(case)
    result = search(cost, galva_options(case, case.batch_size, case.micro_batches))
    return time.perf_counter() - t0, result


def evaluate_in_galva(case: Case, strategy) -> tuple[float, list[float]]:
    """Throughput and per-stage memory of `strategy` under Galva's cost model."""
    got = galva_breakdown(case, strategy)
    return got["throughput"], got["stage_memory_mib"]


def galva_breakdown(case: Case, strategy) -> dict[str, Any]:
    """`strategy` under Galva's cost model: throughput and, per stage, memory with its terms (MiB)."""
    from galva_schema import DataParallelType
    from galva_search.cost_model import VocabOption
    from galva_search.search import evaluate_strategy

    cost = galva_cost_model(case)
    ev = evaluate_strategy(cost, strategy)
    d = ev.detail
    assert d is not None
    pp, c = strategy.pp, strategy.num_micro_batches
    vocab = VocabOption(tp=strategy.vocab.tp, sp=strategy.vocab.sp,
                        zero3=strategy.vocab_dp_type is DataParallelType.ZERO3)
    vt = cost.vocab_terms(pp, vocab, strategy.micro_batch_size, c, cost.in_flight(pp, c))
    context = cost.settings.context_mib
    layer_states = [st - v.states_mib for st, v in zip(d.stage_states_mib, vt)]
    layer_act = [m - context - tr - v.memory_mib - ls
                 for m, tr, v, ls in zip(d.stage_memory_mib, d.stage_transient_mib, vt, layer_states)]
    from galva_search.convert import candidate_of

    time_terms: dict[str, dict[str, float]] = {}
    for i in range(strategy.num_layers):
        cand = candidate_of(strategy, i)
        key = reference_label(strategy, i)
        if key in time_terms:
            continue
        t = cost.layer_terms(0, [cand], strategy.micro_batch_size, c)
        time_terms[key] = {
            "forward_ms": 1e3 * float(t.forward_s[0]),
            "backward_ms": 1e3 * float(t.backward_s[0]),
            "tp_ms": 1e3 * float(t.tp_comm_s[0]),
            "zero3_ms": 1e3 * float(t.zero3_comm_s[0]),
            "dp_sync_ms": 1e3 * float(t.grad_sync_s[0]),  # once per ITERATION (the reference: per micro-batch)
            "exposed_sync_ms": 1e3 * float(t.exposed_sync_s[0]),
            "p2p_ms": 1e3 * float(t.p2p_s[0]),
            "micro_batch_ms": 1e3 * float(t.micro_batch_s[0]),
        }
    return {
        "time_terms": time_terms,
        "stage_vocab_mib": [v.memory_mib for v in vt],  # vocabulary states + in-flight activations
        "stage_layer_states_mib": layer_states,
        "stage_layer_activation_mib": layer_act,  # in-flight micro-batches included
        "throughput": ev.throughput_samples_per_s,
        "iteration_s": ev.iteration_time_s,
        "stage_memory_mib": list(ev.stage_memory_mib),
        "stage_states_mib": list(d.stage_states_mib),  # layers + vocabulary
        "stage_activation_mib": [a * n for a, n in zip(d.stage_activation_mib, d.stage_in_flight)],
        "stage_in_flight": list(d.stage_in_flight),
        "stage_transient_mib": list(d.stage_transient_mib),
        "context_mib": cost.settings.context_mib,
    }


def reference_label(strategy, index: int) -> str:
    """The reference's form_strategy label of layer `index` (`1-2*-8`, `2-4-2f-c`, ...), to match its terms."""
    layer = strategy.layers[index]
    stage = strategy.world_size // strategy.pp
    dp = stage // layer.tp
    tp_part, dp_part = str(layer.tp), str(dp)
    if dp > 1 and layer.dp_type is not None and layer.dp_type.value == "zero3":
        dp_part += "f"
    if 1 < layer.tp < stage:
        if layer.tp_consecutive:
            tp_part += "*"
        else:
            dp_part += "*"
    if layer.checkpoint:
        dp_part += "-c"
    return f"{strategy.pp}-{tp_part}-{dp_part}"


def time_terms_table(rows: list[Row]) -> str:
    """Per layer strategy of the two plans where they differ: the reference's TimeCostModel terms against Galva's
    layer_terms, ms per layer per micro-batch (dp sync: the reference per micro-batch, Galva once per iteration)."""
    lines = [
        "| case | layer (reference label) | compute fwd+bwd | tp | dp sync (message time) | Galva's exposed sync "
        "(per iteration) | p2p | layer total: reference with comm / no comm, Galva micro-batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.galva_plan == r.galvatron_plan:
            continue
        for plan in ("galva", "galvatron"):
            ref_terms = _ref(r, plan, "time_terms") or {}
            gal_terms = _gal(r, plan, "time_terms") or {}
            for key, rt in ref_terms.items():
                gt = gal_terms.get(key)
                if gt is None:
                    continue
                lines.append(
                    f"| {r.case} ({'Galva' if plan == 'galva' else 'Galvatron'}) | `{key}` | "
                    f"{rt['forward_ms'] + rt['backward_ms']:.2f} / {gt['forward_ms'] + gt['backward_ms']:.2f} | "
                    f"{rt['tp_ms']:.2f} / {gt['tp_ms']:.2f} | {rt['dp_sync_ms']:.2f} / {gt['dp_sync_ms']:.2f} | "
                    f"{gt['exposed_sync_ms']:.2f} | {rt['p2p_ms']:.2f} / {gt['p2p_ms']:.2f} | "
                    f"{rt['with_comm_ms']:.2f} / {rt['no_comm_ms']:.2f}, {gt['micro_batch_ms']:.2f} |"
                )
    return "\n".join(lines)


def evaluate_in_reference(case: Case, plans: dict[str, dict]) -> dict[str, Any]:
    """Score reference-format plans with Galvatron's own cost model, in its venv (galvatron_eval.py)."""
    d = case_dirs(case)
    plans_path = os.path.join(d["base"], "reference-eval-plans.json")
    out_path = os.path.join(d["base"], "reference-eval.json")
    with open(plans_path, "w") as f:
        json.dump({"plans": plans}, f, indent=1)
    subprocess.run(
        [VENV_PY, os.path.join(HERE, "galvatron_eval.py"), os.path.join(d["base"], "galvatron-case.json"),
         plans_path, out_path],
        check=True, capture_output=True, text=True,
    )
    with open(out_path) as f:
        return json.load(f)


def describe(strategy) -> str:
    """`pp2 c8 vtp4 | 16x tp4 | 16x tp4-c` style: runs of equal layer strategies per stage."""
    parts = [f"pp{strategy.pp} c{strategy.num_micro_batches} vtp{strategy.vocab.tp}"]
    start = 0
    for count in strategy.pp_division:
        runs: list[list] = []
        for layer in strategy.layers[start : start + count]:
            label = f"tp{layer.tp}{'' if layer.tp_consecutive else 'n'}"
            label += f"-{layer.dp_type.value}" if layer.dp_type else ""
            label += "-c" if layer.checkpoint else ""
            label += "-u" if layer.ulysses else ""
            if runs and runs[-1][1] == label:
                runs[-1][0] += 1
            else:
                runs.append([1, label])
        parts.append(", ".join(f"{n}x {label}" for n, label in runs))
        start += count
    return " | ".join(parts)


def run_case(case: Case, args: argparse.Namespace) -> Row:
    row = Row(case.name)
    d = case_dirs(case)
    result_path = os.path.join(d["base"], "galvatron-result.json")
    if args.reuse_reference and os.path.exists(result_path):
        with open(result_path) as f:
            ref = json.load(f)
    else:
        print(f"[{case.name}] Galvatron search ...", flush=True)
        ref = run_galvatron(case, args.timeout)
    row.galvatron_s = ref["wall_s"]
    row.galvatron_dp_s = ref["dp_s"]
    row.galvatron_dp_calls = ref["dp_calls"]
    row.galvatron_own_throughput = ref["throughput"]
    row.galvatron_config = ref["config_path"]
    print(f"[{case.name}] Galvatron: {ref['wall_s']:.1f} s, {ref['throughput']:.3f} samples/s (its model)", flush=True)

    row.core = dp_core_bench.replay(d["capture"], threads=0)
    print(f"[{case.name}] DP core replay: {row.core}", flush=True)

    try:
        galva_s, result = run_galva(case)
    except Exception as e:  # the planner is another engineer's work in progress; report, do not hide
        row.notes.append(f"galva planner failed: {type(e).__name__}: {e}")
        print(f"[{case.name}] galva planner failed: {e!r}", flush=True)
        return row
    row.galva_s = galva_s
    row.galva_throughput = float(result.summary.throughput_samples_per_s)
    row.galva_plan = describe(result.strategy)
    row.usable_mib = float(result.summary.usable_memory_mib)
    print(f"[{case.name}] Galva: {galva_s:.3f} s, {result.summary.throughput_samples_per_s:.3f} samples/s", flush=True)
    from galva_schema.reference import read_galvatron_strategy, to_galvatron_strategy

    row.galva_model["galva"] = galva_breakdown(case, result.strategy)
    plans = {"galva": to_galvatron_strategy(result.strategy)}
    if row.galvatron_config:
        try:
            ref_strategy = read_galvatron_strategy(row.galvatron_config, world_size=case.nodes * case.gpus_per_node)
            row.galvatron_plan = describe(ref_strategy)
            row.galva_model["galvatron"] = galva_breakdown(case, ref_strategy)
            throughput, memory = evaluate_in_galva(case, ref_strategy)
            row.galvatron_plan_throughput_in_galva, row.galvatron_plan_memory_mib = throughput, memory
            with open(row.galvatron_config) as f:
                plans["galvatron"] = json.load(f)
        except Exception as e:
            row.notes.append(f"evaluating Galvatron's plan failed: {type(e).__name__}: {e}")
    try:
        got = evaluate_in_reference(case, plans)
        row.reference_model, row.reference_profile = got["plans"], got["profile"]
    except subprocess.CalledProcessError as e:
        row.notes.append(f"the reference's cost model failed: {e.stderr[-500:]}")
    for name, r in row.reference_model.items():
        print(f"[{case.name}] {name} plan under the reference's model: {r['throughput']:.3f} samples/s, "
              f"stage memory {[round(m) for m in r['stage_memory_mb']]} MB of {r['budget_mb']:.0f}"
              f"{'' if r['in_space'] else ' (not in its space: ' + '; '.join(r['notes']) + ')'}", flush=True)
    return row


def run_wide() -> list[dict[str, Any]]:
    from galva_search.search import search

    out = []
    by_name = {c.name: c for c in CASES}
    for name, batches, micro_batches in WIDE:
        case = by_name[name]
        t0 = time.perf_counter()
        result = search(galva_cost_model(case), galva_options(case, batches, micro_batches))
        wall = time.perf_counter() - t0
        out.append({
            "case": name,
            "batch_sizes": f"{batches[0]}..{batches[-1]} step {batches[1] - batches[0]}",
            "micro_batches": "all" if micro_batches is None else str(micro_batches),
            "tasks": result.summary.counts.tasks,
            "solved": result.summary.counts.solved,
            "galva_s": wall,
            "throughput": float(result.summary.throughput_samples_per_s),
            "plan": f"bsz {result.strategy.global_batch_size}, " + describe(result.strategy),
        })
        print(f"[wide {name}] {wall:.3f} s, {result.summary.throughput_samples_per_s:.3f} samples/s", flush=True)
    return out


def wide_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | batch sizes | micro-batches | tasks (solved) | Galva search (s) | best samples/s (Galva model) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['batch_sizes']} | {r['micro_batches']} | {r['tasks']} ({r['solved']}) | "
            f"{r['galva_s']:.3f} | {r['throughput']:.3f} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- report
def fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def table(rows: list[Row]) -> str:
    lines = [
        "| case | Galvatron search (s) | Galva search (s) | speed-up | Galvatron plan, samples/s (Galva model) "
        "| Galva plan, samples/s (Galva model) | Galvatron DP calls: ref core (s) / Galva core (s) / optima equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speed = r.galvatron_s / r.galva_s if r.galvatron_s and r.galva_s else None
        core = r.core
        core_cell = "—"
        if core:
            agree = "yes" if core["mismatches"] == 0 else f"NO ({core['mismatches']})"
            core_cell = (
                f"{core['dp_calls']} of {r.galvatron_dp_calls}: {core['reference_core_s']:.2f} / "
                f"{core['galva_serial_s']:.3f} / {agree}"
            )
        lines.append(
            f"| {r.case} | {fmt(r.galvatron_s, '.1f')} | {fmt(r.galva_s, '.3f')} | "
            f"{'—' if speed is None else f'{speed:.0f}×'} | {fmt(r.galvatron_plan_throughput_in_galva, '.3f')} | "
            f"{fmt(r.galva_throughput, '.3f')} | {core_cell} |"
        )
    return "\n".join(lines)


def _ref(r: Row, plan: str, key: str) -> Any:
    return r.reference_model.get(plan, {}).get(key)


def _gal(r: Row, plan: str, key: str) -> Any:
    return r.galva_model.get(plan, {}).get(key)


def _ints(values: list[float] | None) -> str:
    return "—" if not values else " / ".join(f"{v:.0f}" for v in values)


def models_table(rows: list[Row]) -> str:
    """Both plans under both cost models (samples/s)."""
    lines = [
        "| case | Galvatron plan: Galvatron model / Galva model | Galva plan: Galvatron model / Galva model "
        "| Galva plan vs Galvatron plan: Galvatron model / Galva model |",
        "|---|---|---|---|",
    ]
    for r in rows:
        rg, rr = _ref(r, "galvatron", "throughput"), _ref(r, "galva", "throughput")
        gg, gr = _gal(r, "galvatron", "throughput"), _gal(r, "galva", "throughput")

        def rel(a: float | None, b: float | None) -> str:
            return "—" if a is None or b is None else f"{100 * (a / b - 1):+.1f}%"

        own = r.galvatron_own_throughput
        check = "" if own is None or rg is None or abs(rg / own - 1) < 1e-9 else f" (its search said {own:.3f})"
        lines.append(
            f"| {r.case} | {fmt(rg, '.3f')}{check} / {fmt(gg, '.3f')} | {fmt(rr, '.3f')} / {fmt(gr, '.3f')} | "
            f"{rel(rr, rg)} / {rel(gr, gg)} |"
        )
    return "\n".join(lines)


def memory_table(rows: list[Row]) -> str:
    """Per stage: the reference's accounting (what its DP adds, + its 20% cache) against its budget, the same without
    its two artefacts (the ZeRO ratios' +0.003 and the rounding up to whole MB), and Galva's model."""
    lines = [
        "| case | plan | Galvatron accounting per stage (MiB, its cache included) | budget | fits | "
        "same without its +0.003 pad and MB rounding | fits | Galva model per stage + reserve (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for plan in ("galva", "galvatron"):
            mem = _ref(r, plan, "stage_memory_mb")
            if mem is None:
                continue
            budget = _ref(r, plan, "budget_mb")
            exact = _ref(r, plan, "stage_memory_exact_mb") or []
            reserve = budget - (r.usable_mib or 0.0)
            gmem = [m + reserve for m in (_gal(r, plan, "stage_memory_mib") or [])]
            fits_ref = "yes" if _ref(r, plan, "fits") else f"**no** (+{max(mem) - budget:.0f})"
            fits_exact = "yes" if exact and max(exact) <= budget else "**no**"
            name = "Galva's" if plan == "galva" else "Galvatron's"
            lines.append(
                f"| {r.case} | {name} | {_ints(mem)} | {budget:.0f} | {fits_ref} | {_ints(exact)} | {fits_exact} | "
                f"{_ints(gmem)} |"
            )
    return "\n".join(lines)


def terms_table(rows: list[Row]) -> str:
    """Galva's plan, the stage the reference finds fullest, term by term (MiB): Galvatron / Galva."""
    lines = [
        "| case | stage | layer model states | layer activations (in flight) | vocab layers | context | "
        "transients | ZeRO +0.003 pad | MB rounding | cache / reserve | total | Galva − Galvatron |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref, gal = r.reference_model.get("galva"), r.galva_model.get("galva")
        if not ref or not gal:
            continue
        s = max(range(len(ref["stage_memory_mb"])), key=lambda k: ref["stage_memory_mb"][k])
        context = 1024.0  # the reference's pytorch_context_mem, part of its "other" memory
        states_u = ref["stage_layer_states_unpadded_mb"][s]
        act = ref["stage_layer_activation_mb"][s]
        vocab_u = ref["stage_other_unpadded_mb"][s] - context
        pad = (ref["stage_layer_states_mb"][s] - states_u) + (
            ref["stage_other_unrounded_mb"][s] - ref["stage_other_unpadded_mb"][s])
        rounding = (ref["stage_layers_mb"][s] - ref["stage_layer_states_mb"][s] - act) + (
            ref["stage_other_mb"][s] - ref["stage_other_unrounded_mb"][s])
        total = ref["stage_memory_mb"][s]
        g = {k: gal[k][s] for k in ("stage_layer_states_mib", "stage_layer_activation_mib", "stage_vocab_mib",
                                     "stage_transient_mib", "stage_memory_mib")}
        reserve = ref["budget_mb"] - (r.usable_mib or 0.0)
        g_total = g["stage_memory_mib"] + reserve
        lines.append(
            f"| {r.case} | {s} | {states_u:.1f} / {g['stage_layer_states_mib']:.1f} | "
            f"{act:.1f} / {g['stage_layer_activation_mib']:.1f} | {vocab_u:.1f} / {g['stage_vocab_mib']:.1f} | "
            f"{context:.0f} / {gal['context_mib']:.0f} | 0 / {g['stage_transient_mib']:.0f} | {pad:.1f} / 0 | "
            f"{rounding:.1f} / 0 | {ref['mem_cache_mb']:.0f} / {reserve:.0f} | {total:.0f} / {g_total:.1f} | "
            f"{g_total - total:+.1f} |"
        )
    return "\n".join(lines)


def write_readme(rows: list[Row], wide: list[dict[str, Any]], command: str) -> None:
    with open(README) as f:
        text = f.read()
    body = (
        f"{BEGIN}\n"
        f"Produced by `{command}` on {platform.machine()} ({os.cpu_count()} CPUs), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n{table(rows)}\n"
    )
    notes = [f"- {r.case}: {n}" for r in rows for n in r.notes]
    plans = [f"- {r.case}: Galvatron `{r.galvatron_plan}`; Galva `{r.galva_plan}`" for r in rows if r.galva_plan]
    if plans:
        body += "\nChosen plans:\n" + "\n".join(plans) + "\n"
    if any(r.reference_model for r in rows):
        body += "\nBoth plans under both cost models (samples/s; Galvatron's model is its own code, run by "
        body += "`galvatron_eval.py` in its venv):\n\n" + models_table(rows) + "\n"
        body += "\nMemory: each plan under Galvatron's accounting (what its DP adds for the plan, plus the 20% "
        body += "cache it keeps off the budget) and under Galva's:\n\n" + memory_table(rows) + "\n"
        body += "\nGalva's plan, term by term, on the stage Galvatron finds fullest (MiB, Galvatron / Galva):\n\n"
        body += terms_table(rows) + "\n"
        body += "\nTime terms of the layer strategies of both plans where the plans differ (ms per layer per "
        body += "micro-batch, Galvatron / Galva):\n\n" + time_terms_table(rows) + "\n"
    if wide:
        body += "\nGalva alone, wider searches (Galvatron would need hours for these):\n\n" + wide_table(wide) + "\n\n"
        body += "\n".join(f"- {r['case']}: {r['plan']}" for r in wide) + "\n"
    if notes:
        body += "\nNotes:\n" + "\n".join(notes) + "\n"
    body += END
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < 0:
        text = text.rstrip() + "\n\n" + body + "\n"
    else:
        text = text[:start] + body + text[end + len(END):]
    with open(README, "w") as f:
        f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", help="case names (default: all)")
    ap.add_argument("--reuse-reference", action="store_true", help="reuse Galvatron results left in .work/")
    ap.add_argument("--write-readme", action="store_true", help="write the table into README.md")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per Galvatron search")
    ap.add_argument("--galva-reserve", choices=("reference", "galva"), default="reference",
                    help="Galva's memory reserve: Galvatron's 20%% above 20 GB (default, the same usable memory) or "
                    "Galva's own default (5%%)")
    ap.add_argument("--state-accounting", choices=("reference", "galva-hp"), default="reference",
                    help="Galva's model-state bytes: its default (the reference's 2+2+12 formulas without the pad) or "
                    "what galva-hp holds (bf16 fp32 gradients, measured by galva-profile check)")
    ap.add_argument("--results", default="results.json", help="file name under .work/ for the results")
    args = ap.parse_args()
    global RESERVE, STATE_ACCOUNTING
    RESERVE = args.galva_reserve
    STATE_ACCOUNTING = args.state_accounting
    ensure_galvatron_venv()
    gdir = galvatron_dir()
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    inputs.prepare_profiles(gdir, os.path.join(WORK, "profiles"))
    for c in cases:
        inputs.prepare_hardware(gdir, case_dirs(c)["hardware"], c.nodes, c.gpus_per_node)
    rows = [run_case(c, args) for c in cases]
    wide = [] if args.cases else run_wide()
    with open(os.path.join(WORK, args.results), "w") as f:
        json.dump({"cases": [asdict(r) for r in rows], "wide": wide}, f, indent=1)
    print(table(rows))
    if any(r.reference_model for r in rows):
        print(models_table(rows))
        print(memory_table(rows))
        print(terms_table(rows))
        print(time_terms_table(rows))
    if wide:
        print(wide_table(wide))
    if args.write_readme:
        command = " ".join([".venv/bin/python benchmarks/search/run.py", *sys.argv[1:]])
        write_readme(rows, wide, command)


if __name__ == "__main__":
    main()
