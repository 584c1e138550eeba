"""How a small, launch-bound layer's time reads on a GPU: the model profile's synchronised passes against the same
passes run back to back (as a training step runs them), the host's own time per pass, and the kernels' time.

    python benchmarks/costmodel/gpu_layer_timing.py     # on a GPU machine (tools/gpu_checks.sh runs it)

The layer is `galva run`'s default Llama layer (hidden 128, 4 heads / 2 KV, ffn 352, sequence 128, bf16); then the
profile's round robin over batch sizes with and without a pass of the same size before each timed one; the last
line is a plain transformers training step of the 4-layer model (AdamW), timed back to back.
"""

from __future__ import annotations

import statistics
import time

import torch

from galva_profiler.layer_timing import layer_forward, time_interleaved, time_passes
from galva_profiler.model_source import MetaModel
from galva_profiler.timing import Repeats

SEQ, HIDDEN, DTYPE = 128, 128, torch.bfloat16


def config() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, intermediate_size=352,
        num_hidden_layers=4, vocab_size=512, max_position_embeddings=SEQ,
    )  # fmt: skip


def back_to_back(run: object, n: int = 30) -> tuple[float, float]:
    """(wall ms, host CPU ms) per forward + backward, ``n`` of them queued without a synchronisation between."""
    for _ in range(5):
        out = run()  # type: ignore[operator]
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
        out = run()  # type: ignore[operator]
        out.backward(torch.ones_like(out))
    cpu = time.thread_time() - cpu
    torch.cuda.synchronize()
    return (time.perf_counter() - wall) * 1e3 / n, cpu * 1e3 / n


def kernel_ms(run: object, n: int = 10) -> float:
    """The GPU kernels' own ms per forward + backward (torch.profiler's device time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            out = run()  # type: ignore[operator]
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return total / 1e3 / n


def whole_step(n: int = 20) -> float:
    """Median ms of a plain transformers training step of the 4-layer model, batch 16, back to back."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config(), dtype=DTYPE).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 512, (16, SEQ), device="cuda")
    times = []
    for i in range(n + 5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def round_robin(module: torch.nn.Module, device: torch.device, lead: int, span_s: float = 4.0) -> dict[int, tuple]:
    """The profile's round robin over batch sizes 1, 4, 16 (:func:`time_interleaved`: every timed pass after one of
    another shape), with ``lead`` untimed passes of the same shape before each timed one: median (forward,
    backward) ms per size."""
    runs = {b: layer_forward(module, b, SEQ, HIDDEN, DTYPE, device) for b in (1, 4, 16)}
    got = time_interleaved(runs, Repeats(2, 5), device, span_s=span_s, lead=lead)
    return {b: (t.forward_ms, t.backward_ms) for b, t in got.items()}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_layer_timing.py: torch sees no CUDA device here")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    print(torch.cuda.get_device_name(device), "torch", torch.__version__)
    model = MetaModel.build(config(), "galva-run-default")
    module = model.layer(0, DTYPE).train().to(device)
    print(f"torch threads {torch.get_num_threads()}; per forward + backward of one layer, ms:")
    print(f"{'batch':>5} {'profile fwd':>11} {'profile bwd':>11} {'back-to-back':>12} {'host cpu':>9} {'kernels':>8}")
    for batch in (1, 4, 16):
        run = layer_forward(module, batch, SEQ, HIDDEN, DTYPE, device)
        passes = time_passes(run, Repeats(5, 30), device)
        wall, cpu = back_to_back(run)
        print(
            f"{batch:5d} {passes.forward_ms:11.3f} {passes.backward_ms:11.3f} {wall:12.3f} {cpu:9.3f} "
            f"{kernel_ms(run):8.3f}"
        )
    for lead in (0, 1):
        got = round_robin(module, device, lead)
        print(f"round robin, {lead} untimed pass(es) of the same shape first: "
              + ", ".join(f"batch {b} {f:.3f} + {w:.3f}" for b, (f, w) in got.items()))  # fmt: skip
    print(f"plain transformers step, 4 layers, batch 16, AdamW: {whole_step():.2f} ms")


if __name__ == "__main__":
    main()
