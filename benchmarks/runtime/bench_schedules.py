"""Step time of galva-hp's pipeline schedules on 4 CPU ranks, as a ratio to 1F1B, beside the cost model's prediction.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime/bench_schedules.py --profile --write-readme

``--pp 4`` (default; one rank per stage), 4 micro-batches: the bubble of 1F1B is 3 of 7 forward+backward slots per
stage. ``--pp 2``: 2 ranks, 1 of 5. Cases, all on the same model (tiny GPT, 8 layers, untied embeddings, fp32) and
the same global batch:

- galva ``gpipe``, ``1f1b``, ``interleaved-1f1b`` (v = 2, chunk c on stage c % pp), ``zb-h1``;
- ``torch.distributed.pipelining``'s ``Schedule1F1B`` (one ``PipelineStage`` per rank, ``scale_grads=False``) and
  ``ScheduleInterleaved1F1B`` (two ``PipelineStage`` per rank) on the same split of the layers.

A step is forward + backward + global-norm clipping + AdamW (``galva_hp.train_step`` on the galva side). The cases run
in the same four forked gloo ranks, interleaved step by step; the reported time is the median over the measured
steps, and a ratio the median over the rounds of the two cases' steps in one round: a burst of a slower processor
(seconds, on a shared machine) or a drift falls on both sides of a pair (a ratio of the two medians, zb-h1's at pp 4,
read 0.95 to 1.07 in runs of one quiet day). The prediction is ``galva_search.evaluate_strategy`` on profiles of this
machine: ``--profile`` writes them (``galva-profile model`` of a GPT-2 config of the same sizes, ``galva-profile
hardware --nproc-per-node PP``) under ``benchmarks/runtime/.work/``; without them the column says so. ``--trace N``:
N more steps of each galva case with the executor's ops timed per rank (``schedule_trace.py``), printed as a per-op
decomposition beside replays of the schedule with the measured op durations.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_dp import _clip_global, _steps  # same directory: the global-norm clip and the interleaved step timer
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from galva_comm.testing import run_distributed
from galva_hp import BuildOptions, GalvaOptimizer, OptimConfig, build, reference_optimizer, train_step
from galva_hp.testing.models import tiny_gpt
from galva_schema import Strategy

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
WORK = HERE / ".work"
OPTIM = OptimConfig(lr=1e-4, max_grad_norm=1.0)
VOCAB = 1024
SCHEDULES = {  # case -> (pipeline_schedule, virtual_stages)
    "gpipe": ("gpipe", 1),
    "1f1b": ("1f1b", 1),
    "interleaved-1f1b": ("interleaved-1f1b", 2),
    "zb-h1": ("zb-h1", 1),
}


def _make(args):  # type: ignore[no-untyped-def]
    return tiny_gpt(
        vocab_size=VOCAB, hidden=args.hidden, heads=4, layers=args.layers, seq_len=args.seq, tie_embeddings=False
    )


def strategy(args, schedule: str, v: int) -> Strategy:  # type: ignore[no-untyped-def]
    return Strategy.uniform(
        world_size=args.pp,
        num_layers=args.layers,
        global_batch_size=args.batch,
        pp=args.pp,
        num_micro_batches=args.micro_batches,
        pipeline_schedule=schedule,
        virtual_stages=v,
        mixed_precision="fp32",
    )


class Chunk(nn.Module):
    """Layers ``layers`` of the single-process model, with the embedding in front (first chunk) or the final norm and
    the LM head behind (last chunk): one ``PipelineStage``'s module."""

    def __init__(self, model, layers: range, first: bool, last: bool) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.embedding = model.embedding if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm, self.lm_head = (*model.head.children(),) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(x) if self.embedding is not None else x
        for layer in self.layers:
            hidden = layer(hidden)
        if self.lm_head is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden



def _torch_run(args, rank: int, ids, labels, tokens: int, v: int):  # type: ignore[no-untyped-def]
    """A step of the same model under torch.distributed.pipelining: Schedule1F1B (v = 1) or Interleaved1F1B."""
    whole, chunks = _make(args), args.pp * v
    per = args.layers // chunks
    stages, modules = [], []
    for j in range(v):
        c = rank + args.pp * j
        module = Chunk(whole, range(c * per, (c + 1) * per), c == 0, c == chunks - 1)
        modules.append(module)
        stages.append(PipelineStage(module, c, chunks, torch.device("cpu")))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / tokens

    n = args.micro_batches
    if v == 1:
        schedule = Schedule1F1B(stages[0], n, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn, scale_grads=False)
    params = [p for m in modules for p in m.parameters()]
    optimizer, _ = reference_optimizer(params, OPTIM)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        kwargs = {}
        if rank == args.pp - 1:
            kwargs = {"target": labels, "losses": []}
        if rank == 0:
            schedule.step(ids, **kwargs)
        else:
            schedule.step(**kwargs)
        _clip_global(params, OPTIM.max_grad_norm)
        optimizer.step()

    return step


def bench(rank: int, world_size: int, args) -> dict[str, float]:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq))
    labels = torch.roll(ids, -1, 1)
    runs = {}
    for name, (schedule, v) in SCHEDULES.items():
        model = build(_make(args), strategy(args, schedule, v), BuildOptions(seq_len=args.seq))
        optimizer = GalvaOptimizer(model.param_records(), OPTIM)
        runs[f"galva-{name}"] = lambda m=model, o=optimizer: train_step(m, o, ids, labels)
    runs["torch-1f1b"] = _torch_run(args, rank, ids, labels, labels.numel(), 1)
    runs["torch-interleaved-1f1b"] = _torch_run(args, rank, ids, labels, labels.numel(), 2)
    if args.cases:
        runs = {name: run for name, run in runs.items() if name in args.cases}
    steps = _steps(runs, args)
    times = {name: statistics.median(values) for name, values in steps.items()}
    if not args.trace:
        return {"times": times, "steps": steps}
    import schedule_trace

    schedule_trace.install()  # after the timed steps: they ran the runtime untouched
    traces: dict[str, list] = {name: [] for name in runs if name.startswith("galva")}
    for _ in range(args.trace):
        for name in traces:
            dist.barrier()
            schedule_trace.take()
            start = time.perf_counter()
            runs[name]()
            wall = time.perf_counter() - start
            traces[name].append((start, wall, schedule_trace.take()))
    return {"times": times, "steps": steps, "trace": traces}


# ------------------------------------------------------------------------------------------------ prediction
def profile(args) -> None:  # type: ignore[no-untyped-def]
    """Model and hardware profiles of this machine for the cost model (minutes)."""
    from transformers import GPT2Config

    WORK.mkdir(exist_ok=True)
    config = GPT2Config(
        n_embd=args.hidden, n_layer=args.layers, n_head=4, vocab_size=VOCAB, n_positions=args.seq,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        # the benchmarked tiny_gpt's layer: exact GELU, no dropout (GPT-2's defaults, tanh GELU and dropout 0.1,
        # made the profiled forward 1.7x and backward 1.25x the benchmarked one's, CPU time, batch 2)
        activation_function="gelu", resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    config.save_pretrained(WORK / "gpt")
    micro = args.batch // args.micro_batches
    cli = [sys.executable, "-m", "galva_profiler.cli"]
    subprocess.run(
        [*cli, "model", "--model-config", "gpt", "--seq-lengths", str(args.seq), "--batch-sizes", f"1,{micro}",
         "--max-tp", "1", "--precision", "fp32", "--quiet", "-o", "model.json"],
        cwd=WORK, check=True,
    )  # fmt: skip
    subprocess.run(
        [*cli, "hardware", "--nproc-per-node", str(args.pp), "--quick", "--quiet", "-o", f"hw{args.pp}.json"],
        cwd=WORK,
        check=True,
    )


def predictions(args) -> dict[str, float] | None:  # type: ignore[no-untyped-def]
    """Predicted step time (s) of each galva case, or None without profiles."""
    hardware = WORK / f"hw{args.pp}.json"
    if not (WORK / "model.json").exists() or not hardware.exists():
        return None
    from galva_schema import HardwareProfile, ModelProfile
    from galva_search.cost_model import CostModel, CostSettings
    from galva_search.evaluation import evaluate_strategy

    cost = CostModel(HardwareProfile.load(hardware), ModelProfile.load(WORK / "model.json"), CostSettings())
    return {
        f"galva-{name}": evaluate_strategy(cost, strategy(args, schedule, v)).iteration_time_s
        for name, (schedule, v) in SCHEDULES.items()
    }


def _priced_inputs(args) -> str:  # type: ignore[no-untyped-def]
    """The profiles' figures the schedules' ratios hang on: zb-h1's split overhead and the p2p latency."""
    hardware = WORK / f"hw{args.pp}.json"
    if not (WORK / "model.json").exists() or not hardware.exists():
        return "no profiles: run with --profile"
    from galva_schema import HardwareProfile, ModelProfile

    layer = ModelProfile.load(WORK / "model.json").layer_types[0]
    hw = HardwareProfile.load(hardware)
    return (f"priced: split backward overhead {layer.split_backward_overhead_ms} ms per layer call, p2p latency "
            f"{hw.p2p_latency_ms(args.pp):.3f} ms, compute slowdown {hw.compute_slowdown:.2f}, processors "
            f"{hw.processors_per_node}")  # fmt: skip


def paired_ratio(steps: dict[str, list[float]], case: str, base: str) -> float:
    """Median over the rounds of ``case``'s step / ``base``'s step in the same round."""
    return statistics.median(a / b for a, b in zip(steps[case], steps[base]))


def table(  # type: ignore[no-untyped-def]
    result: dict[str, float], steps: dict[str, list[float]], predicted: dict[str, float] | None, args
) -> str:
    rows = [
        "| case | ms/step | measured ratio to galva 1F1B (median of a round's pair) | predicted ratio (cost model) |",
        "|---|---|---|---|",
    ]
    for name, ms in result.items():
        ratio = f"{paired_ratio(steps, name, 'galva-1f1b'):.3f}"
        guess = "—"
        if predicted is not None and name in predicted:
            guess = f"{predicted[name] / predicted['galva-1f1b']:.3f} ({predicted[name] * 1e3:.0f} ms)"
        elif predicted is None and name.startswith("galva"):
            guess = "no profiles (run with --profile)"
        rows.append(f"| {name} | {ms:.1f} | {ratio} | {guess} |")
    if "torch-1f1b" not in result or "torch-interleaved-1f1b" not in result:
        return "\n".join(rows) + "\n"
    vs = paired_ratio(steps, "galva-1f1b", "torch-1f1b")
    vs_i = paired_ratio(steps, "galva-interleaved-1f1b", "torch-interleaved-1f1b")
    setup = (
        f"tiny GPT hidden {args.hidden}, {args.layers} layers, seq {args.seq}, global batch {args.batch}, "
        f"{args.micro_batches} micro-batches, vocab {VOCAB}, fp32, untied, pp {args.pp} on {args.pp} forked gloo ranks "
        f"(1 thread each), {args.steps} rounds of one step of each case after {args.warmup} warm-up rounds"
    )
    return (
        "\n".join(rows)
        + f"\n\ngalva 1F1B / torch Schedule1F1B: **{vs:.3f}** (target ≤ 1.05); galva interleaved / torch "
        f"ScheduleInterleaved1F1B: {vs_i:.3f}.\n\nSetup: {setup}.\n"
    )


def decomposition(traces: list[dict[str, list]], args) -> str:  # type: ignore[no-untyped-def]
    """Per case and rank, the median over the traced steps of ms per kind of op (wall, and CPU in brackets), and the
    replay of the stages' orders with the measured op durations and instant messages (schedule_trace.replay)."""
    import schedule_trace

    from galva_comm.schedules import schedule_order
    from galva_schema import PipelineSchedule

    kinds = ["F", "B", "I", "W", "recv", "send", "wait-sends", "grad-sync", "clip", "optimizer", "zero-grad", "other"]
    lines = [
        "| case | rank | step | " + " | ".join(kinds) + " | recv wait | replay |",
        "|---" * (len(kinds) + 5) + "|",
    ]
    notes: list[str] = []
    cpu_ms: dict[str, float] = {}
    for name in traces[0]:
        schedule, v = SCHEDULES[name.removeprefix("galva-")]
        orders = [
            schedule_order(PipelineSchedule(schedule), s, args.pp, args.micro_batches, v) for s in range(args.pp)
        ]
        replays, cpu_replays, per_rank, delays = [], [], [], []
        for step in range(args.trace):
            events = [traces[rank][name][step][2] for rank in range(args.pp)]
            for out, clock in ((replays, "wall"), (cpu_replays, "cpu")):
                durations = [{(e.kind, e.chunk, e.micro_batch): getattr(e, clock) for e in ev if e.kind in "FBIW"}
                             for ev in events]  # fmt: skip
                out.append(schedule_trace.replay(orders, durations, args.pp * v))
            delays.extend(schedule_trace.message_delays(events))
        replay_ms = statistics.median(replays) * 1e3
        cpu_ms[name] = statistics.median(cpu_replays) * 1e3
        if delays:
            notes.append(
                f"{name}: {len(delays) / args.trace:.0f} messages a step reach a waiting receiver, delay median "
                f"{statistics.median(delays) * 1e3:.2f} ms, mean {statistics.mean(delays) * 1e3:.2f} ms, "
                f"max {max(delays) * 1e3:.2f} ms"
            )
        for rank in range(args.pp):
            rows = [schedule_trace.summary(ev, start, wall) for start, wall, ev in traces[rank][name]]
            med = {key: statistics.median(r.get(key, 0.0) for r in rows) for key in {k for r in rows for k in r}}
            per_rank.append(med)
            cells = [
                f"{med.get(k, 0.0):.1f}" + (f" ({med[k + ' cpu']:.1f})" if k + " cpu" in med else "") for k in kinds
            ]
            lines.append(
                f"| {name} | {rank} | {med['step']:.1f} | " + " | ".join(cells)
                + f" | {med['recv wait']:.1f} | {replay_ms:.1f} |"
            )
    if "galva-1f1b" in cpu_ms:
        notes.append(
            "replay of the ops' CPU times (instant messages, no load), ratio to 1F1B: "
            + ", ".join(f"{name} {ms / cpu_ms['galva-1f1b']:.3f} ({ms:.0f} ms)" for name, ms in cpu_ms.items())
        )
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4, help="stages = ranks (one rank per stage)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (one step of every case each)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="(re)write the profiles for the prediction column")
    parser.add_argument("--cases", nargs="+", help="only these cases (galva-1f1b always included), e.g. galva-zb-h1")
    parser.add_argument("--write-readme", action="store_true")
    parser.add_argument(
        "--trace", type=int, default=0, metavar="STEPS",
        help="after the timed steps, trace STEPS more of each galva case and print where each rank's time went",
    )  # fmt: skip
    parser.add_argument("--dump", type=Path, help="with --trace: write every rank's traced events here (pickle)")
    args = parser.parse_args()
    if args.cases:
        args.cases = sorted({"galva-1f1b", *args.cases})
    if args.profile:
        profile(args)
    ranks = run_distributed(bench, args.pp, args, timeout=1800, threads_per_rank=1)
    text = table(ranks[0]["times"], ranks[0]["steps"], predictions(args), args)
    print(text)
    print(_priced_inputs(args))
    if args.trace:
        print(decomposition([r["trace"] for r in ranks], args))
        if args.dump:
            import pickle

            args.dump.write_bytes(pickle.dumps([r["trace"] for r in ranks]))
    if args.write_readme:
        readme = README.read_text()
        mark = f"<!-- schedules pp{args.pp} -->"
        start = readme.index(mark) + len(mark)
        end = readme.index(f"<!-- /schedules pp{args.pp} -->")
        README.write_text(readme[:start] + "\n" + text + readme[end:])


if __name__ == "__main__":
    main()
