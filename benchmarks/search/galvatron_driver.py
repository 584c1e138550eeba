"""Run PKU Galvatron's search engine (hetu-galvatron 2.4.0) on one case and time it.

Runs inside benchmarks/search/.venv-galvatron (see run.py), never in Galva's venv. Usage:

    python galvatron_driver.py CASE.json OUT.json

CASE.json: {"num_nodes", "num_gpus_per_node", "memory_gb", "layers", "hidden", "seq", "model_name", "profile_dir",
"hardware_dir", "output_dir", "log_dir", "search": {extra search arguments, e.g. "settle_bsz": 32}}.
Optional "capture_dir"/"capture_max": save the inputs and results of the first DP calls (for run.py's core benchmark).
OUT.json gets {"wall_s", "dp_s", "dp_calls", "throughput", "config_path"}; Galvatron's own prints go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types


def import_search_engine():
    # galvatron/core/__init__.py pulls in the runtime (apex, megatron); the search engine needs none of it.
    import galvatron

    core = types.ModuleType("galvatron.core")
    core.__path__ = [os.path.join(galvatron.__path__[0], "core")]
    sys.modules["galvatron.core"] = core
    from galvatron.core.search_engine.arguments import galvatron_search_args
    from galvatron.core.search_engine.search_engine import GalvatronSearchEngine

    return GalvatronSearchEngine, galvatron_search_args


def instrument_dp(capture_dir: str | None, capture_max: int) -> dict:
    """Time every DPAlg.fit call; optionally save the inputs and results of the first `capture_max` of them."""
    import numpy as np
    from galvatron.core.search_engine import dynamic_programming

    totals = {"dp_calls": 0, "dp_s": 0.0}
    original = dynamic_programming.DPAlg.fit

    def fit(self):
        t0 = time.perf_counter()
        result = original(self)
        elapsed = time.perf_counter() - t0
        totals["dp_s"] += elapsed
        totals["dp_calls"] += 1
        n = totals["dp_calls"]
        if capture_dir and n <= capture_max and self.fine_grained_mode and self.strategy_num > 1:
            keys = sorted(self.other_mem_cost)
            np.savez(
                os.path.join(capture_dir, f"dp_{n:04d}.npz"),
                memory=self.v_data,
                intra=self.intra_cost,
                inter=self.inter_cost,
                max_mem=self.max_mem - 1,
                k=np.array(keys),
                other_mem=np.array([self.other_mem_cost[k] for k in keys], dtype=np.float64),
                other_time=np.array([self.other_time_cost[k] for k in keys], dtype=np.float64),
                total_cost=np.array([result[0][k] for k in keys], dtype=np.float64),
                remaining=np.array([result[2][k] for k in keys], dtype=np.float64),
                seconds=np.array(elapsed),
            )
        return result

    dynamic_programming.DPAlg.fit = fit
    return totals


def main() -> None:
    case_path, out_path = sys.argv[1], sys.argv[2]
    with open(case_path) as f:
        case = json.load(f)
    engine_cls, add_args = import_search_engine()
    args = add_args(argparse.ArgumentParser()).parse_args([])
    args.num_nodes = case["num_nodes"]
    args.num_gpus_per_node = case["num_gpus_per_node"]
    args.memory_constraint = case["memory_gb"]
    args.memory_profiling_path = case["profile_dir"]
    args.time_profiling_path = case["profile_dir"]
    args.allreduce_bandwidth_config_path = case["hardware_dir"]
    args.p2p_bandwidth_config_path = case["hardware_dir"]
    args.overlap_coe_path = case["hardware_dir"]
    args.sp_time_path = case["hardware_dir"]
    args.output_config_path = case["output_dir"]
    args.log_dir = case["log_dir"]
    for key, value in case.get("search", {}).items():
        if not hasattr(args, key):
            raise SystemExit(f"unknown Galvatron search argument {key!r}")
        setattr(args, key, value)
    # Fields the model's own argument parser would add (read by the DP for inter-layer costs).
    args.hidden_size = case["hidden"]
    args.num_hidden_layers = case["layers"]
    args.seq_length = case["seq"]

    capture = case.get("capture_dir")
    if capture:
        os.makedirs(capture, exist_ok=True)
    totals = instrument_dp(capture, case.get("capture_max", 0))
    t0 = time.perf_counter()
    engine = engine_cls(args)
    engine.set_search_engine_info(
        case["profile_dir"],
        [{"hidden_size": case["hidden"], "layer_num": case["layers"], "seq_len": case["seq"]}],
        case["model_name"],
    )
    engine.set_model_type("gpt")
    engine.initialize_search_engine()
    throughput = engine.parallelism_optimization()
    wall = time.perf_counter() - t0

    bsz = f"_bsz{args.settle_bsz}" if args.settle_bsz > 0 else ""
    name = (
        f"galvatron_config_{case['model_name']}_{args.num_nodes}nodes_{args.num_gpus_per_node}gpus_per_node_"
        f"{args.memory_constraint}GB_{args.mixed_precision}{bsz}.json"
    )
    config_path = os.path.join(case["output_dir"], name)
    with open(out_path, "w") as f:
        json.dump(
            {
                "wall_s": wall,
                **totals,
                "throughput": float(throughput),
                "config_path": config_path if os.path.exists(config_path) else None,
            },
            f,
        )


if __name__ == "__main__":
    main()
