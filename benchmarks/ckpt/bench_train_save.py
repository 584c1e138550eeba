"""Training-time save and load: Galva's sharded layerwise writer against plain torch.distributed.checkpoint (DCP).

4 forked gloo ranks, a small Llama (fp32, with AdamW state after one step), two plans. Per rank: seconds to save
and to load, bytes written. Galva writes each rank's blocks in place into the per-module files of the layerwise
format (full tensors, Hugging Face names: readable by g2h under any plan). DCP (FileSystemWriter) writes each
rank's local tensors into its own ``__<rank>_0.distcp`` file plus ``.metadata``; plain tensors (tp shards,
replicated norms) are keyed per rank, DTensors (ZeRO-3 shards) by name. DCP's ``HuggingFaceStorageWriter`` with
``save_distributed`` + ``enable_consolidation`` is timed too: it writes per-rank shard files and then rewrites them
as consolidated full tensors.

    .venv/bin/python benchmarks/ckpt/bench_train_save.py            # prints a markdown table
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = ["--model", "tiny-llama", "--hidden-size", "256", "--num-attention-heads", "8", "--num-query-groups", "4",
         "--ffn-hidden-size", "704", "--vocab-size", "8192", "--num-layers", "4"]  # fmt: skip
COMMON = ["--fp32", "--global-batch-size", "4", "--seq-length", "32", "--no-progress", "--train-iters", "1"]
PLANS = {
    "pp2 x tp2 (ddp)": ["--pp", "2", "--tp", "2", "--vocab-tp", "2", "--chunks", "2"],
    "zero3 dp4": ["--sdp", "--chunks", "1"],
}


def _size(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def bench(rank: int, world: int, argv: list[str], root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from galva_hp import BuildOptions, GalvaOptimizer, OptimConfig, build, train_step
    from galva_models.checkpointing import open_source, scheduler_state
    from galva_models.cli.config import parse_train_config
    from galva_models.cli.train import build_model, checkpoint_io, make_source

    cfg = parse_train_config(argv, world_size=world)
    _, layered = build_model(cfg)
    model = build(layered, cfg.strategy, BuildOptions(seq_len=cfg.seq_length))
    optimizer = GalvaOptimizer(model.param_records(), OptimConfig())
    batch = make_source(cfg).batch(0)
    train_step(model, optimizer, batch.inputs, batch.labels)
    out: dict[str, Any] = {}

    start = time.perf_counter()
    io = checkpoint_io(cfg, model, optimizer)
    out["placements_s"] = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    stats = io.save(root + "/galva", 1, scheduler_state(optimizer))
    out["galva_save_s"] = time.perf_counter() - start
    out["galva_bytes"] = stats["bytes"]
    dist.barrier()
    start = time.perf_counter()
    io.load(open_source(root + "/galva"))
    out["galva_load_s"] = time.perf_counter() - start

    def state() -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        sd: dict[str, torch.Tensor] = {}
        for record in model.param_records():
            p = record.param
            key = record.name if isinstance(p, DTensor) else f"{record.name}@rank{rank}"
            sd[f"model/{key}"] = p.data if not isinstance(p, DTensor) else p
            for moment in ("exp_avg", "exp_avg_sq"):
                sd[f"optim/{moment}/{key}"] = optimizer.optimizer.state[p][moment]
        return sd

    dist.barrier()
    start = time.perf_counter()
    dcp.save(state(), checkpoint_id=root + "/dcp")
    out["dcp_save_s"] = time.perf_counter() - start
    dist.barrier()
    files = [Path(root, "dcp", f"__{rank}_0.distcp")] + ([Path(root, "dcp", ".metadata")] if rank == 0 else [])
    out["dcp_bytes"] = float(_size(files))
    target = state()
    start = time.perf_counter()
    dcp.load(target, checkpoint_id=root + "/dcp")
    out["dcp_load_s"] = time.perf_counter() - start

    dist.barrier()
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        sd = state()
        start = time.perf_counter()
        writer = HuggingFaceStorageWriter(root + "/dcp_hf", save_distributed=True, enable_consolidation=True)
        dcp.save(sd, storage_writer=writer)
        out["dcp_hf_save_s"] = time.perf_counter() - start
        dist.barrier()
        if rank == 0:
            out["dcp_hf_bytes_total"] = float(_size(list(Path(root, "dcp_hf").rglob("*"))))
    except Exception as err:  # a benchmark reports what failed
        out["dcp_hf_error"] = str(err).splitlines()[0]
    return out


def main() -> int:
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    from galva_comm.testing import run_distributed

    print("| plan | rank | galva save s | galva load s | galva MB written | DCP save s | DCP load s | DCP MB written |"
          " save time ratio galva/DCP | bytes ratio galva/DCP |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    extra = []
    for label, plan in PLANS.items():
        root = tempfile.mkdtemp(prefix="galva-bench-")
        try:
            results = run_distributed(bench, 4, [*MODEL, *COMMON, *plan], root, timeout=600)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for rank, r in enumerate(results):
            print(
                f"| {label} | {rank} | {r['galva_save_s']:.3f} | {r['galva_load_s']:.3f} | {r['galva_bytes'] / 1e6:.2f}"
                f" | {r['dcp_save_s']:.3f} | {r['dcp_load_s']:.3f} | {r['dcp_bytes'] / 1e6:.2f}"
                f" | {r['galva_save_s'] / r['dcp_save_s']:.2f} | {r['galva_bytes'] / max(r['dcp_bytes'], 1):.2f} |"
            )
        r0 = results[0]
        extra.append(
            f"{label}: placements (once per run) {max(r['placements_s'] for r in results):.2f} s; DCP HF writer "
            + (
                f"(sharded + consolidated) save {max(r.get('dcp_hf_save_s', 0) for r in results):.3f} s, "
                f"{r0['dcp_hf_bytes_total'] / 1e6:.2f} MB on disk in all"
                if "dcp_hf_bytes_total" in r0
                else f"failed: {r0.get('dcp_hf_error')}"
            )
            + f"; galva total {sum(r['galva_bytes'] for r in results) / 1e6:.2f} MB, plain DCP total"
            f" {sum(r['dcp_bytes'] for r in results) / 1e6:.2f} MB"
        )
    print()
    for line in extra:
        print("- " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
