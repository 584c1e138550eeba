"""Per-step time of galva-hp's data parallelism against plain PyTorch, side by side on the same 2 CPU ranks.

    .venv/bin/python benchmarks/runtime/bench_dp.py [--hidden 256] [--layers 4] [--seq 128] [--batch 8] [--steps 12]

Cases (every step = forward + backward + gradient reduction + global-norm clipping + AdamW step, fp32):

- galva dp2 ``ddp``   vs ``torch.nn.parallel.DistributedDataParallel`` around the single-process model;
- galva dp2 ``zero3`` vs FSDP2 ``fully_shard`` per layer + root (``reshard_after_forward=True``);
- galva pp2 x dp2 ``ddp`` (1F1B, 4 ranks) vs ``torch.distributed.pipelining`` (``PipelineStage`` +
  ``Schedule1F1B``) with each stage wrapped in torch DDP over its stage's dp group (the schedule skips DDP's
  all-reduce on all but the last micro-batch, as galva does). Untied embeddings on both sides (a tie across stages
  would cost galva one extra all-reduce that plain pipelining does not do).

Both sides train the same tiny GPT (:func:`galva_hp.testing.models.tiny_gpt`) on the same batches, in the same two
forked gloo ranks; the cases are interleaved step by step so that machine noise hits both alike, and the reported
time is the median over the measured steps (after warm-up). Prints a Markdown table; ``--write-readme`` replaces the
table in ``benchmarks/runtime/README.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel

from galva_comm.testing import run_distributed
from galva_hp import BuildOptions, GalvaOptimizer, OptimConfig, build, reference_optimizer, train_step
from galva_hp.testing.models import tiny_gpt
from galva_schema import Strategy

README = Path(__file__).with_name("README.md")
OPTIM = OptimConfig(lr=1e-4, max_grad_norm=1.0)


class Whole(nn.Module):
    """The single-process model as one module (what plain DDP / FSDP2 wrap)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.embedding, self.layers, self.head = model.embedding, nn.ModuleList(model.layers), model.head

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embedding(ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden, labels)


def _make(args, tie: bool = True):
    return tiny_gpt(
        vocab_size=1024, hidden=args.hidden, heads=4, layers=args.layers, seq_len=args.seq, tie_embeddings=tie
    )


def _plain_step(module, params, optimizer, ids, labels, tokens):
    optimizer.zero_grad(set_to_none=True)
    loss_sum, _ = module(ids, labels)
    (loss_sum / tokens).backward()
    torch.nn.utils.clip_grad_norm_(params, OPTIM.max_grad_norm)
    optimizer.step()


def bench(rank: int, world_size: int, args) -> dict[str, float]:
    torch.manual_seed(0)
    ids = torch.randint(0, 1024, (args.batch, args.seq))
    labels = torch.roll(ids, -1, 1)
    tokens = labels.numel()
    local = slice(rank * args.batch // world_size, (rank + 1) * args.batch // world_size)
    runs = {}

    for dp_type in ("ddp", "zero3"):
        strategy = Strategy.uniform(
            world_size=world_size,
            num_layers=args.layers,
            global_batch_size=args.batch,
            default_dp_type=dp_type,
            mixed_precision="fp32",
        )
        model = build(_make(args), strategy, BuildOptions(seq_len=args.seq))
        optimizer = GalvaOptimizer(model.param_records(), OPTIM)
        runs[f"galva-{dp_type}"] = lambda m=model, o=optimizer: train_step(m, o, ids, labels)

    ddp = DistributedDataParallel(Whole(_make(args)))
    ddp_params = list(ddp.parameters())
    ddp_opt, _ = reference_optimizer(ddp_params, OPTIM)
    runs["torch-ddp"] = lambda: _plain_step(ddp, ddp_params, ddp_opt, ids[local], labels[local], tokens)

    fsdp = Whole(_make(args))
    fsdp.head.lm_head.weight = nn.Parameter(fsdp.head.lm_head.weight.detach().clone())  # FSDP2: no sharing across units
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for layer in fsdp.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_params = list(fsdp.parameters())
    fsdp_opt, _ = reference_optimizer(fsdp_params, OPTIM)
    runs["torch-fsdp2"] = lambda: _plain_step(fsdp, fsdp_params, fsdp_opt, ids[local], labels[local], tokens)

    return _time(runs, args)


class FirstStage(nn.Module):
    def __init__(self, model, layers: range) -> None:
        super().__init__()
        self.embedding, self.layers = model.embedding, nn.ModuleList(model.layers[i] for i in layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class LastStage(nn.Module):
    def __init__(self, model, layers: range) -> None:
        super().__init__()
        self.layers, self.norm, self.lm_head = nn.ModuleList(model.layers[i] for i in layers), *model.head.children()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return self.lm_head(self.norm(hidden))


def _clip_global(params: list[nn.Parameter], max_norm: float) -> None:
    """Clip by the norm over every stage (what galva's optimizer does): one all-reduce of the squared norm."""
    total = torch.zeros(1)
    for p in params:
        if p.grad is not None:
            total += p.grad.pow(2).sum()
    dist.all_reduce(total)
    scale = min(1.0, max_norm / (float(total.sqrt()) + 1e-6))
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)


def bench_pipeline(rank: int, world_size: int, args) -> dict[str, float]:
    """pp2 x dp2 on 4 ranks: stage s holds ranks {2s, 2s+1}; pipelines are (0, 2) and (1, 3)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 1024, (args.batch, args.seq))
    labels = torch.roll(ids, -1, 1)
    tokens = labels.numel()
    stage, dp_rank = divmod(rank, 2)
    local = slice(dp_rank * args.batch // 2, (dp_rank + 1) * args.batch // 2)
    strategy = Strategy.uniform(
        world_size=world_size,
        num_layers=args.layers,
        global_batch_size=args.batch,
        pp=2,
        num_micro_batches=args.micro_batches,
        pipeline_schedule="1f1b",
        default_dp_type="ddp",
        mixed_precision="fp32",
    )
    model = build(_make(args, tie=False), strategy, BuildOptions(seq_len=args.seq))
    optimizer = GalvaOptimizer(model.param_records(), OPTIM)
    runs = {"galva-pp2-dp2": lambda: train_step(model, optimizer, ids, labels)}

    pipelines = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    whole, half = _make(args, tie=False), args.layers // 2
    module = FirstStage(whole, range(half)) if stage == 0 else LastStage(whole, range(half, args.layers))
    ddp = DistributedDataParallel(module, process_group=dps[stage])
    # one plain iteration first: DDP records its bucket order in the first synchronised backward, and under a
    # schedule's no_sync micro-batches that record would double (a torch assertion at the next forward)
    warm = ids[local] if stage == 0 else torch.randn(args.batch // 2, args.seq, args.hidden)
    ddp(warm).float().sum().backward()
    ddp.zero_grad(set_to_none=True)
    pipe = PipelineStage(ddp, stage, 2, torch.device("cpu"), group=pipelines[dp_rank])

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # scale_grads=False: the global token count already makes the sum the global mean, as in galva
        return (
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum") / tokens
        )

    schedule = Schedule1F1B(pipe, args.micro_batches, loss_fn=loss_fn, scale_grads=False)
    params = list(ddp.parameters())
    torch_opt, _ = reference_optimizer(params, OPTIM)

    def torch_step() -> None:
        torch_opt.zero_grad(set_to_none=True)
        if stage == 0:
            schedule.step(ids[local])
        else:
            schedule.step(target=labels[local], losses=[])
        _clip_global(params, OPTIM.max_grad_norm)
        torch_opt.step()

    runs["torch-pp2-dp2"] = torch_step
    return _time(runs, args)


def _steps(runs: dict, args) -> dict[str, list[float]]:
    """ms of every timed step of each run, interleaved step by step (step ``i`` of every run in one round), barriers
    around every step."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.warmup + args.steps):
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()
            if step >= args.warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def _time(runs: dict, args) -> dict[str, float]:
    """Median ms per step of each run, interleaved step by step (:func:`_steps`)."""
    return {name: statistics.median(values) for name, values in _steps(runs, args).items()}


def table(result: dict[str, float], args) -> str:
    rows = [
        "| case | galva ms/step | baseline ms/step | ratio (target ≤ 1.05) |",
        "|---|---|---|---|",
    ]
    cases = [
        ("dp2 ddp vs torch DDP", "galva-ddp", "torch-ddp"),
        ("dp2 zero3 vs FSDP2 fully_shard", "galva-zero3", "torch-fsdp2"),
        (
            f"pp2 x dp2 ddp 1F1B ({args.micro_batches} micro-batches, 4 ranks) vs torch pipelining + DDP",
            "galva-pp2-dp2",
            "torch-pp2-dp2",
        ),
    ]
    for title, galva, torch_ in cases:
        if galva in result:
            ratio = result[galva] / result[torch_]
            rows.append(f"| {title} | {result[galva]:.1f} | {result[torch_]:.1f} | {ratio:.3f} |")
    rows.append("| single-GPU throughput / MFU | open (no GPU in this session) | | |")
    setup = (
        f"tiny GPT hidden {args.hidden}, {args.layers} layers, seq {args.seq}, global batch {args.batch}, vocab 1024, "
        f"fp32, 2 forked gloo ranks (4 for pp2 x dp2), median of {args.steps} steps after {args.warmup} warm-up steps"
    )
    return "\n".join(rows) + f"\n\nSetup: {setup}.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--micro-batches", type=int, default=2, help="pp2 x dp2 case")
    parser.add_argument("--only", choices=["dp", "pp"], help="run only the dp2 cases or only the pp2 x dp2 case")
    parser.add_argument("--write-readme", action="store_true")
    args = parser.parse_args()
    result: dict[str, float] = {}
    if args.only != "pp":
        result.update(run_distributed(bench, 2, args, timeout=1200, threads_per_rank=args.threads)[0])
    if args.only != "dp":
        result.update(run_distributed(bench_pipeline, 4, args, timeout=1200, threads_per_rank=args.threads)[0])
    text = table(result, args)
    print(text)
    if args.write_readme:
        readme = README.read_text()
        start, end = readme.index("<!-- table -->") + len("<!-- table -->"), readme.index("<!-- /table -->")
        README.write_text(readme[:start] + "\n" + text + readme[end:])


if __name__ == "__main__":
    main()
