"""Score given plans with PKU Galvatron's own cost model (hetu-galvatron 2.4.0), as its search scores them.

Runs inside benchmarks/search/.venv-galvatron (see run.py), never in Galva's venv. Usage:

    python galvatron_eval.py CASE.json PLANS.json OUT.json

CASE.json: the case file galvatron_driver.py reads (profiles, hardware, memory constraint, search settings).
PLANS.json: {"plans": {name: reference strategy dict (galvatron_config_*.json keys, as
galva_schema.reference.to_galvatron_strategy writes them)}}.
OUT.json: {"profile": what the engine read from the profile files, "plans": {name: result}} where a result has

* ``stage_memory_mb``: per stage, what the search's DP adds up for this plan (every layer's ``enc_total`` rounded up
  to whole MB, plus the stage's ``other`` memory of the chosen vocab degree rounded up, plus the Megatron-SP global
  buffer when on) PLUS the 20% "pytorch memory cache" it keeps off the budget above 20 GB; ``budget_mb`` =
  memory_constraint * 1024. The plan fits the reference's accounting iff every stage is <= budget_mb.
* ``stage_layers_mb`` / ``stage_other_mb`` / ``mem_cache_mb``: those three parts; ``layer_terms``: per distinct layer
  strategy and stage, its model states and activation (MB).
* ``iteration_s`` / ``throughput``: ``pipeline_costmodel`` (the function the search's DP ranks plans with) with
  the plan's layers, partition, chunks and the vocab time of its vtp (``OtherTimeCostModel``).
* ``in_space``: whether the search itself would consider this plan for (bsz, chunk, min_tp, max_tp) (its strict
  chunk rule, the vtp keys its profiles have); ``notes`` say why not.

The plan's context is taken as the search enumerates it: min_tp = min(layer tps, vtp), max_tp = max(layer tps,
vtp) (global_memory_buffer on: max_tp runs over the same degrees as min_tp), mbsz = ceil(bsz / (W/pp/min_tp) /
chunk).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from galvatron_driver import import_search_engine


def _layer_strategy(pp: int, tp: int, world: int, consec: int, zero3: int, ckpt: int, sp_space: str) -> list:
    """The per-layer list the search generates (generate_dp_tp_pp_sdp + the cpt copy): [pp, tp, dp, info]."""
    dp = world // (pp * tp)
    info: dict[str, int] = {}
    if 1 < tp < world // pp:
        info["tp"] = consec
    if dp > 1:
        info["fsdp"] = zero3
    if tp > 1 and sp_space in ("tp", "tp+sp"):
        info["sp"] = 0
    if ckpt:
        info["cpt"] = 1
    return [pp, tp, dp, info]


def _unpadded(model):
    """The same MemoryCostModel with its ZeRO ratios' `+0.003` on 1/d removed (each ratio is a*(1/d + 0.003) + b,
    so a = 2*(r(1) - r(2)) and the pad is a*0.003), states and "other" memory recomputed by its own methods."""
    for name in ("zero2_ratio", "zero3_ratio"):
        f = getattr(model, name)
        setattr(model, name, lambda d, f=f: f(d) - 2 * (f(1) - f(2)) * 0.003)
    model.estimate_model_states_size()
    model.estimate_other_memory_cost()
    return model.get_memory_cost()


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",")]


def evaluate(engine, args, config: dict) -> dict:
    import numpy as np
    from galvatron.core.search_engine.cost_model import (
        MemoryCostModel,
        OtherTimeCostModel,
        TimeCostModel,
        pipeline_costmodel,
    )
    from galvatron.utils import form_strategy

    world = args.gpu_num
    pp = int(config["pp_deg"])
    tps = _ints(config["tp_sizes_enc"])
    consec = _ints(config["tp_consecutive_flags"])
    zero3 = _ints(config["dp_types_enc"])
    ckpt = _ints(config.get("checkpoint", ",".join("0" * len(tps))))
    division = _ints(config["pp_division"])
    bsz, chunk = int(config["global_bsz"]), int(config["chunks"])
    vtp, vsp, embed_sdp = int(config.get("vtp", 1)), int(config.get("vsp", 0)), int(config.get("embed_sdp", 0))
    notes: list[str] = []
    if config.get("pipeline_type", args.pipeline_type) != args.pipeline_type:
        notes.append(f"pipeline_type {config.get('pipeline_type')} differs from the search's {args.pipeline_type}")
    if config.get("default_dp_type", args.default_dp_type) != args.default_dp_type:
        notes.append(f"default_dp_type {config.get('default_dp_type')} differs from {args.default_dp_type}")
    layers = [_layer_strategy(pp, t, world, c, z, k, args.sp_space) for t, c, z, k in zip(tps, consec, zero3, ckpt)]
    min_tp, max_tp = min(min(tps), vtp), max(max(tps), vtp)
    mbsz = (bsz // (world // pp // min_tp) + chunk - 1) // chunk

    # Would the search consider this (bsz, chunk, min_tp, max_tp) and these layer strategies?
    in_space = True
    space = [form_strategy(s) for s in engine.strategies]
    for s in layers:
        if form_strategy(s) not in space:
            in_space = False
            notes.append(f"layer strategy {form_strategy(s)} is not in the search space")
            break
    if bsz % (world // pp // min_tp):
        in_space = False
        notes.append(f"bsz {bsz} not divisible by W/pp/min_tp = {world // pp // min_tp}")
    for s in {form_strategy(s): s for s in layers}.values():
        real = (bsz // (world // s[0] // min_tp) + mbsz - 1) // mbsz
        if real != chunk or chunk > bsz // (world // s[0] // min_tp):
            in_space = False
            notes.append(f"chunk {chunk} is not the search's real chunk count {real} at min_tp {min_tp}")
            break

    margs = dict(
        model_args=engine.model_args_list[0],
        train_args=engine.train_args_list[0],
        parallel_args=engine.parallel_args_list[0],
        profile_model_args=engine.profile_model_args_list[0],
    )
    # The "other" (vocab) memory comes from the first strategy of the DP's set for this pp (DpOnModel: the set is
    # the search's strategies with pp, min_tp <= tp <= max_tp, in generation order): that is what the search adds.
    stage_set = [s for s in engine.strategies if s[0] == pp and min_tp <= s[1] <= max_tp]
    stage_set = [s for s in stage_set if "sp" not in s[-1] or s[-1]["sp"] == 0]
    first = stage_set[0] if stage_set else layers[0]
    per_stage_layers: list[float] = []
    per_stage_states: list[float] = []
    per_stage_states_unpadded: list[float] = []
    per_stage_other_unpadded: list[float] = []
    per_stage_other_raw: list[float] = []
    per_stage_act: list[float] = []
    per_stage_other: list[float] = []
    layer_terms: dict[str, list[dict]] = {}
    other_mem = None
    start = 0
    for stage in range(pp):
        total = states = act = states_unpadded = 0.0
        kw = dict(mbsz=mbsz, min_tp=min_tp, max_tp=max_tp, vsp=vsp, embed_sdp=embed_sdp, **margs)
        if args.pipeline_type == "pipedream_flush":
            kw["stage_idx"] = stage
        cache: dict[str, dict] = {}
        for s in layers[start:start + division[stage]]:
            key = form_strategy(s)
            if key not in cache:
                cache[key] = MemoryCostModel(s, bsz, **kw).get_memory_cost()
                cache[key]["model_states_unpadded"] = _unpadded(MemoryCostModel(s, bsz, **kw))["model_states"]
                layer_terms.setdefault(key, []).append({
                    "stage": stage,
                    "model_states": float(cache[key]["model_states"]),
                    "activation": float(cache[key]["activation"]),
                })
            total += math.ceil(cache[key]["enc_total"])
            states += float(cache[key]["model_states"])
            states_unpadded += float(cache[key]["model_states_unpadded"])
            act += float(cache[key]["activation"])
        if other_mem is None:
            other_mem = MemoryCostModel(first, bsz, **kw).get_memory_cost()["other"]
            other_unpadded = _unpadded(MemoryCostModel(first, bsz, **kw))["other"]
        if vtp not in other_mem:
            in_space = False
            notes.append(f"vtp {vtp} has no 'other' memory entry (keys {sorted(other_mem)})")
            other = float("nan")
            per_stage_other_unpadded.append(other)
            per_stage_other_raw.append(other)
        else:
            other = float(np.ceil(other_mem[vtp][stage]))
            per_stage_other_unpadded.append(float(other_unpadded[vtp][stage]))
            per_stage_other_raw.append(float(other_mem[vtp][stage]))
        if args.sequence_parallel and args.global_memory_buffer:
            gm = mbsz / min_tp * max_tp * args.hidden_size * args.seq_length * 4 / 1024 / 1024
            other += int(gm / 2 if args.mixed_precision != "fp32" else gm)
        per_stage_layers.append(total)
        per_stage_states.append(states)
        per_stage_states_unpadded.append(states_unpadded)
        per_stage_act.append(act)
        per_stage_other.append(other)
        start += division[stage]
    budget = engine.memory_constraint
    mem_cache = int(budget * 0.2) if budget // 1024 > 20 else 0
    stage_memory = [a + b + mem_cache for a, b in zip(per_stage_layers, per_stage_other)]
    # The same sum without its two artefacts: the +0.003 pad of the ZeRO ratios and the rounding up to whole MB
    # (per layer and for "other"); the Megatron-SP buffer (off in these cases) is not part of this figure.
    stage_memory_exact = [s + a + o + mem_cache for s, a, o in
                          zip(per_stage_states_unpadded, per_stage_act, per_stage_other_unpadded)]

    # Time: the search's pipeline_costmodel with the vocab time of this vtp.
    other_time = OtherTimeCostModel(mbsz, pp, world, vsp, embed_sdp, min_tp, max_tp, engine.seqlen_list,
                                    model_args=engine.model_args_list[0], train_args=engine.train_args_list[0],
                                    parallel_args=engine.parallel_args_list[0],
                                    profile_model_args=engine.profile_model_args_list[0],
                                    profile_hardware_args=engine.profile_hardware_args_list[0]).gen_result()
    iteration = float("nan")
    stage_time: list[float] = []
    if vtp in other_time[1]:
        dp_size = world // pp
        chunks = [p.optimal_chunk_func(bsz * min_tp // dp_size, [pp, min_tp, dp_size], mbsz, min_tp)
                  for p in engine.parallel_args_list]
        stage_cost, iteration = pipeline_costmodel(
            TimeCostModel, engine.layernum_list, engine.model_args_list, engine.train_args_list,
            engine.parallel_args_list, engine.profile_model_args_list, engine.profile_hardware_args_list,
            layers, division, chunks, bsz, min_tp, other_time[1][vtp], return_stage_cost=True)
        stage_time = [float(x) for x in stage_cost]
        iteration = float(iteration)
    else:
        in_space = False
        notes.append(f"vtp {vtp} has no vocab time entry (keys {sorted(other_time[1])})")
    # Per distinct layer strategy, its TimeCostModel terms at the global micro-batch B/c (ms per layer per micro-batch)
    time_terms: dict[str, dict[str, float]] = {}
    targs = dict(model_args=engine.model_args_list[0], train_args=engine.train_args_list[0],
                 parallel_args=engine.parallel_args_list[0], profile_model_args=engine.profile_model_args_list[0],
                 profile_hardware_args=engine.profile_hardware_args_list[0])
    for s in {form_strategy(s): s for s in layers}.values():
        m = TimeCostModel(s, bsz / chunk, **targs)
        per = 1.0 / m.layer_num
        p2p = m.p2p_message_size * m.p2p_comm_coe if m.pp_size > 1 and m.p2p_comm_coe is not None else 0.0
        time_terms[form_strategy(s)] = {
            "forward_ms": m.fct * per,
            "backward_ms": m.bct * per,
            "tp_ms": m.tp_communication_time * per,
            "dp_sync_ms": m.dp_message_size * m.dc * per,
            "p2p_ms": p2p * per,
            "with_comm_ms": 1e3 * m.gen_result(),
            "no_comm_ms": 1e3 * TimeCostModel(s, bsz / chunk, no_comm=True, **targs).gen_result(),
        }
    return {
        "time_terms": time_terms,
        "min_tp": min_tp,
        "max_tp": max_tp,
        "mbsz": mbsz,
        "in_space": in_space,
        "notes": notes,
        "budget_mb": float(budget),
        "mem_cache_mb": float(mem_cache),
        "stage_layers_mb": per_stage_layers,
        "stage_other_mb": per_stage_other,
        "stage_layer_states_mb": per_stage_states,  # unrounded sums (stage_layers_mb rounds each layer up)
        "stage_layer_activation_mb": per_stage_act,  # in-flight micro-batches included (1F1B: pp - stage)
        "vocab_memory_mb": {str(k): [float(x) for x in v] for k, v in (other_mem or {}).items()},
        "stage_memory_mb": stage_memory,
        "fits": all(m <= budget for m in stage_memory),
        "stage_memory_exact_mb": stage_memory_exact,
        "stage_layer_states_unpadded_mb": per_stage_states_unpadded,
        "stage_other_unpadded_mb": per_stage_other_unpadded,
        "stage_other_unrounded_mb": per_stage_other_raw,
        "fits_exact": all(m <= budget for m in stage_memory_exact),
        "layer_terms": layer_terms,
        "iteration_s": iteration,
        "stage_time_s": stage_time,
        "throughput": bsz / iteration if iteration == iteration and iteration > 0 else float("nan"),
    }


def main() -> None:
    case_path, plans_path, out_path = sys.argv[1:4]
    with open(case_path) as f:
        case = json.load(f)
    with open(plans_path) as f:
        plans = json.load(f)["plans"]
    engine_cls, add_args = import_search_engine()
    args = add_args(argparse.ArgumentParser()).parse_args([])
    args.num_nodes = case["num_nodes"]
    args.num_gpus_per_node = case["num_gpus_per_node"]
    args.memory_constraint = case["memory_gb"]
    for key in ("memory_profiling_path", "time_profiling_path"):
        setattr(args, key, case["profile_dir"])
    for key in ("allreduce_bandwidth_config_path", "p2p_bandwidth_config_path", "overlap_coe_path", "sp_time_path"):
        setattr(args, key, case["hardware_dir"])
    args.output_config_path = case["output_dir"]
    args.log_dir = case["log_dir"]
    for key, value in case.get("search", {}).items():
        setattr(args, key, value)
    args.hidden_size = case["hidden"]
    args.num_hidden_layers = case["layers"]
    args.seq_length = case["seq"]
    engine = engine_cls(args)
    engine.set_search_engine_info(
        case["profile_dir"],
        [{"hidden_size": case["hidden"], "layer_num": case["layers"], "seq_len": case["seq"]}],
        case["model_name"],
    )
    engine.set_model_type("gpt")
    engine.initialize_search_engine()
    out = {
        "profile": {
            "forward_ms_per_sample_per_layer": [float(x) for x in engine.time_profiled_list],
            "other_forward_ms_per_sample": [float(x) for x in engine.other_time_profiled_list],
            "time_profile_mode": args.time_profile_mode,
        },
        "plans": {name: evaluate(engine, args, config) for name, config in plans.items()},
    }
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
