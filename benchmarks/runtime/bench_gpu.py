"""Single-device throughput of galva-hp against a plain PyTorch training loop on the same ~1B Llama-style model.

    python benchmarks/runtime/bench_gpu.py                         # on a GPU: ~1.0B parameters, seq 2048, bf16
    python benchmarks/runtime/bench_gpu.py --device cpu --tiny     # smoke test of this script on a CPU

Every side trains :func:`galva_hp.testing.models.tiny_llama` at the given size, from the same seed, on the same
random batches, one after the other in this process (each side: ``--warmup`` steps, then ``--steps`` timed steps,
synchronising the device around each step):

- plain: the single-process model, fp32 weights, ``torch.autocast`` bf16, ``torch.optim.AdamW`` (fused on CUDA),
  ``clip_grad_norm_``;
- ddp: the plain side wrapped in torch's ``DistributedDataParallel`` (the one-rank group: its bucketed fp32
  all-reduce of the gradients);
- fsdp2: torch's ``fully_shard`` on every layer and the root, ``MixedPrecisionPolicy`` bf16 parameters and fp32
  reduction (no autocast), the same optimizer and clipping;
- galva: the same model built by ``galva_hp.build`` under a one-rank ``Strategy`` (bf16 compute, fp32 master weights
  and gradient reduction), stepped with ``galva_hp.train_step`` (AdamW + clipping by the global norm).

Reports tokens/s of each, the ratio galva / plain (target >= 0.95), and model FLOPs utilisation (MFU) against
``--peak-tflops`` (989 = H100 SXM dense bf16). FLOPs per token = 6 N + 12 L H S, with N the parameters outside the
embedding table. ``--write-readme`` records the result in ``benchmarks/runtime/README.md``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from galva_comm.testing import free_port
from galva_hp import BuildOptions, GalvaOptimizer, OptimConfig, build, train_step
from galva_hp.testing.models import tiny_llama
from galva_schema import Strategy

README = Path(__file__).with_name("README.md")
OPTIM = OptimConfig(lr=1e-4, max_grad_norm=1.0)


def make_model(args: argparse.Namespace):
    return tiny_llama(
        vocab_size=args.vocab,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        layers=args.layers,
        seq_len=args.seq,
        ffn=args.ffn,
    )


def flops_per_token(model, args: argparse.Namespace) -> float:
    params = sum(p.numel() for layer in model.layers for p in layer.parameters())
    params += sum(p.numel() for p in model.head.parameters())
    return 6.0 * params + 12.0 * args.layers * args.hidden * args.seq


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, device: torch.device, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        step(i)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


class _Loss(torch.nn.Module):
    """The model's ``reference_loss`` as one module's forward, its parts registered: what DDP and FSDP2 wrap."""

    def __init__(self, model) -> None:
        super().__init__()
        self.embedding, self.layers, self.head = model.embedding, torch.nn.ModuleList(model.layers), model.head
        self.model = model  # a LayeredModel, not a module: the same parts, unregistered twice

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model.reference_loss(ids, labels)


def _wrapped_steps(args, device, batches, wrap, autocast: bool) -> list[float]:
    module = wrap(_Loss(make_model(args)).to(device))
    params = list(module.parameters())
    optimizer = torch.optim.AdamW(
        params,
        lr=OPTIM.lr,
        betas=OPTIM.betas,
        eps=OPTIM.eps,
        weight_decay=OPTIM.weight_decay,
        fused=device.type == "cuda",
    )

    def step(i: int) -> None:
        ids, labels = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = module(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, OPTIM.max_grad_norm)
        optimizer.step()

    return timed_steps(step, device, args.warmup, args.steps)


def run_plain(args: argparse.Namespace, device: torch.device, batches) -> list[float]:
    """The single-process model as it is, autocast bf16."""
    return _wrapped_steps(args, device, batches, lambda module: module, autocast=True)


def run_ddp(args: argparse.Namespace, device: torch.device, batches) -> list[float]:
    """torch's DistributedDataParallel over the one-rank group, autocast bf16, fp32 gradients reduced."""
    from torch.nn.parallel import DistributedDataParallel

    def wrap(module):
        return DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)

    return _wrapped_steps(args, device, batches, wrap, autocast=True)


def run_fsdp2(args: argparse.Namespace, device: torch.device, batches) -> list[float]:
    """torch's FSDP2 (``fully_shard`` per layer and at the root): bf16 parameters, fp32 reduction, no autocast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def wrap(module):
        for layer in module.layers:
            fully_shard(layer, mp_policy=policy)
        return fully_shard(module, mp_policy=policy)

    return _wrapped_steps(args, device, batches, wrap, autocast=False)


def run_galva(args: argparse.Namespace, device: torch.device, batches) -> list[float]:
    model = make_model(args)
    strategy = Strategy.uniform(
        world_size=1, num_layers=args.layers, global_batch_size=args.batch, mixed_precision="bf16"
    )
    built = build(model, strategy, BuildOptions(seq_len=args.seq, device=str(device)))
    optimizer = GalvaOptimizer(built.param_records(), OPTIM)

    def step(i: int) -> None:
        ids, labels = batches[i % len(batches)]
        train_step(built, optimizer, ids, labels)

    return timed_steps(step, device, args.warmup, args.steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="device peak, dense bf16 TFLOP/s")
    ap.add_argument("--tiny", action="store_true", help="a toy size, to check the script itself quickly")
    ap.add_argument("--write-readme", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.ffn = 64, 2, 4, 2, 128
        args.vocab, args.seq, args.batch, args.steps, args.warmup = 256, 32, 2, 3, 1
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # set_device needs an index ("cuda" alone is refused by torch 2.11)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)

    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        labels = torch.roll(ids, -1, dims=1)
        labels[:, -1] = -100
        batches.append((ids.to(device), labels.to(device)))
    reference = make_model(args)
    flops = flops_per_token(reference, args)
    n_params = sum(p.numel() for m in (reference.embedding, *reference.layers, reference.head) for p in m.parameters())
    del reference

    results = {}
    sides = (("plain", run_plain), ("ddp", run_ddp), ("fsdp2", run_fsdp2), ("galva", run_galva))
    for name, run in sides:
        times = run(args, device, batches)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        step_s = statistics.median(times)
        tokens_per_s = args.batch * args.seq / step_s
        results[name] = (step_s, tokens_per_s, tokens_per_s * flops / (args.peak_tflops * 1e12))
    dist.destroy_process_group()

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    ratio = results["galva"][1] / results["plain"][1]
    rows = [
        "| side | ms/step | tokens/s | MFU |",
        "|---|---|---|---|",
        *(f"| {n} | {s * 1e3:.1f} | {t:,.0f} | {m:.1%} |" for n, (s, t, m) in results.items()),
        f"| **galva / plain** | | **{ratio:.3f}** (target ≥ 0.95) | |",
        *(f"| galva / {n} | | {results['galva'][1] / results[n][1]:.3f} | |" for n in ("ddp", "fsdp2")),
    ]
    setup = (
        f"{device_name}; Llama-style {n_params / 1e9:.2f}B parameters (hidden {args.hidden}, {args.layers} layers, "
        f"{args.heads} heads / {args.kv_heads} KV, ffn {args.ffn}, vocab {args.vocab}), seq {args.seq}, batch "
        f"{args.batch}, bf16; median of {args.steps} steps after {args.warmup} warm-up; "
        f"peak {args.peak_tflops} TFLOP/s."
    )
    table = "\n".join(rows) + "\n\n" + setup
    print(table)
    if args.write_readme:
        text = README.read_text()
        start, end = "<!-- gpu-table -->", "<!-- /gpu-table -->"
        if start in text:
            text = text[: text.index(start)] + f"{start}\n{table}\n{end}" + text[text.index(end) + len(end) :]
        else:
            text += f"\n## Single-device throughput (GPU)\n\n{start}\n{table}\n{end}\n"
        README.write_text(text)


if __name__ == "__main__":
    main()
