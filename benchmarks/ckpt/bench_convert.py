"""h2g / g2h throughput (MB/s of weights) against plain transformers from_pretrained + save_pretrained.

    .venv/bin/python benchmarks/ckpt/bench_convert.py [--layers 12] [--hidden 768] [--repeats 3]

One GPT-2-shaped model (random fp32 weights, written once with save_pretrained). Each job runs ``--repeats`` times
in this process into a fresh directory; the best time counts (the machine is shared). The baseline round trip is
what a user does without galva-ckpt: load the model with transformers and save it again.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from galva_ckpt.convert import galva_to_hf, hf_to_galva


def best_seconds(job: Callable[[Path], object], scratch: Path, repeats: int) -> float:
    best = float("inf")
    for i in range(repeats):
        out = scratch / f"out-{i}"
        start = time.perf_counter()
        job(out)
        best = min(best, time.perf_counter() - start)
        shutil.rmtree(out)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        config = GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=12, vocab_size=args.vocab)
        torch.manual_seed(0)
        GPT2LMHeadModel(config).save_pretrained(scratch / "hf")
        size_mb = (scratch / "hf" / "model.safetensors").stat().st_size / 1e6
        hf_to_galva(scratch / "hf", scratch / "galva", progress=False)

        def h2g(out: Path) -> object:
            return hf_to_galva(scratch / "hf", out, progress=False)

        def g2h(out: Path) -> object:
            return galva_to_hf(scratch / "galva", out, progress=False)

        def transformers_round_trip(out: Path) -> object:
            GPT2LMHeadModel.from_pretrained(scratch / "hf", local_files_only=True).save_pretrained(out)
            return None

        times = {
            "h2g": best_seconds(h2g, scratch, args.repeats),
            "g2h": best_seconds(g2h, scratch, args.repeats),
            "transformers load+save": best_seconds(transformers_round_trip, scratch, args.repeats),
        }
    base = times["transformers load+save"]
    print(f"model: gpt2 {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {size_mb:.0f} MB fp32")
    print(f"{'job':<24}{'seconds':>10}{'MB/s':>10}{'time vs transformers':>24}")
    for job, seconds in times.items():
        print(f"{job:<24}{seconds:>10.2f}{size_mb / seconds:>10.0f}{seconds / base:>23.2f}x")


if __name__ == "__main__":
    main()
