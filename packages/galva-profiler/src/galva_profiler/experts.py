"""The routed experts of a mixture-of-experts layer, measured apart from the rest of the layer
(:class:`galva_schema.ExpertProfile`).

* **expert time**: the family's experts module with every row routed to expert 0, at several row counts; the
  least-squares line over rows is one expert's FFN time (its intercept is what each expert call costs, however
  few rows it gets). Timed on CPU here; the model sweep times it again on its device (:func:`time_experts`).
* **router time**: the router module on ``[tokens, hidden]`` rows, per token (the same).
* **imbalance**: the routing every layer of the type really does with random tokens run through the model's depth
  (:mod:`galva_profiler.routing`), per ep degree, the experts in contiguous runs of ``E / ep`` (as galva-models
  splits them): ``imbalance``, the largest run's rows over the mean in one layer (what a layer's compute and
  dispatch wait for), the mean over the type's layers; ``memory_imbalance``, the same of the rows summed over the
  type's layers (a rank keeps every layer's activations, and its busiest layers differ).
* **activations per routed row**: bytes the experts module saves, by saved-tensor hooks, at two row counts; and what
  dispatch and combine keep beyond that, in a forked 2-rank gloo group with the experts split over it by
  galva-models and a routing that sends each rank exactly as many rows as it receives.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from galva_profiler.activation_memory import saved_bytes
from galva_profiler.fitting import alpha_beta
from galva_profiler.layer_timing import on_device
from galva_profiler.timing import Repeats, median_ms
from galva_schema import BatchTime, ExpertProfile

MIB = 2**20
ROWS = (32, 64, 128)
"""Row counts the expert time is measured at."""


def experts_module(layer: nn.Module, ep_table: dict[str, str]) -> tuple[str, nn.Module] | None:
    """``(path, module)`` of the routed experts inside a galva-models table layer (None: a dense layer)."""
    from galva_models.tables.experts import expert_paths

    inner = getattr(layer, "layer", layer)
    for path in expert_paths(ep_table):
        try:
            return path, inner.get_submodule(path)
        except AttributeError:
            continue
    return None


def _call(
    experts: nn.Module, rows: int, hidden: int, dtype: torch.dtype, index: Tensor, device: torch.device | None = None
) -> Tensor:
    x = torch.randn(rows, hidden, dtype=dtype, device=device, requires_grad=True)
    weights = torch.full(index.shape, 1.0 / index.shape[1], dtype=dtype, device=device)
    out: Tensor = experts(x, index.to(x.device), weights)
    return out


def _balanced(tokens: int, top_k: int, experts: int) -> Tensor:
    """Token ``t`` to experts ``t k .. t k + k - 1`` (mod E): every expert gets the same number of rows."""
    return (torch.arange(tokens * top_k) % experts).view(tokens, top_k)


def _time_one_expert(
    experts: nn.Module, rows: int, hidden: int, dtype: torch.dtype, repeats: Repeats, device: torch.device
) -> float:
    """Forward ms of the experts module with all ``rows`` routed to expert 0, on ``device`` (the module's)."""
    to_first = torch.zeros(rows, 1, dtype=torch.long, device=device)
    return median_ms(lambda: _call(experts, rows, hidden, dtype, to_first, device), repeats, device)


def time_experts(
    experts: nn.Module,
    block: nn.Module,
    router: type[nn.Module] | None,
    hidden: int,
    dtype: torch.dtype,
    repeats: Repeats,
    device: torch.device | None = None,
) -> tuple[BatchTime, float]:
    """``(expert time, router ms per token)`` of the modules, on ``device`` (CPU by default: they go there for the
    timing and come back)."""
    device = device or torch.device("cpu")
    with on_device(device, block):  # the experts module is inside it
        times = [_time_one_expert(experts, rows, hidden, dtype, repeats, device) for rows in ROWS]
        router_ms = _router_ms_per_token(block, router, hidden, dtype, repeats, device)
    slope, intercept = alpha_beta(list(ROWS), times).coefficients
    return BatchTime(slope_ms_per_sample=max(0.0, slope), intercept_ms=intercept), router_ms


def figures_by_ep(counts: list[Tensor]) -> dict[int, list[float]]:
    """Largest over mean rows of the ep ranks, the experts split in contiguous runs, for each power-of-two ep
    dividing the expert count, in each forward (``counts``: rows per expert of each forward): a rank holds the
    activations of the forward it ran, not of a pooled one."""
    total = counts[0].numel()
    out = {}
    ep = 1
    while ep <= total:
        if total % ep == 0:
            ratios = []
            for forward in counts:
                per_rank = forward.view(ep, total // ep).sum(dim=1)
                mean = float(per_rank.mean())
                ratios.append(max(1.0, float(per_rank.max()) / mean) if mean > 0 else 1.0)
            out[ep] = ratios
        ep *= 2
    return out


def imbalance_by_ep(counts: list[Tensor]) -> dict[int, float]:
    """:func:`figures_by_ep`, the mean over forwards."""
    return {ep: sum(f) / len(f) for ep, f in figures_by_ep(counts).items()}


def by_layer_and_summed(counts: dict[int, list[Tensor]]) -> tuple[dict[int, float], dict[int, list[float]]]:
    """``(imbalance, memory_imbalance)`` by ep from each layer's rows per expert in each forward: the mean over the
    layers of each one's figure, and each forward's figure of the rows summed over the layers."""
    layers = list(counts.values())
    each = [imbalance_by_ep(c) for c in layers]
    mean = {ep: sum(figures[ep] for figures in each) / len(each) for ep in each[0]}
    return mean, figures_by_ep([sum(forward) for forward in zip(*layers, strict=True)])


def _router_ms_per_token(block: nn.Module, router: type[nn.Module] | None, hidden: int, dtype: torch.dtype,
                         repeats: Repeats, device: torch.device) -> float:  # fmt: skip
    found = [m for m in block.modules() if router is not None and isinstance(m, router)]
    if len(found) != 1:
        return 0.0
    tokens = max(ROWS)
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    return median_ms(lambda: found[0](x), repeats, x.device) / tokens


def _dispatch_worker(rank: int, world: int, experts: nn.Module, path: str, hidden: int, top_k: int, total: int,
                     dtype: torch.dtype) -> int:  # fmt: skip
    """Bytes per routed row dispatch and combine keep beyond the experts' own, on one rank of a 2-rank group."""
    import torch.distributed as dist

    from galva_models.tables.experts import split_experts

    split = copy.deepcopy(experts)
    split_experts(split, path, dist.group.WORLD, None)
    tokens = min(ROWS)

    def growth(module: nn.Module) -> int:
        one = saved_bytes(lambda: _call(module, tokens, hidden, dtype, _balanced(tokens, top_k, total)))
        two = saved_bytes(lambda: _call(module, 2 * tokens, hidden, dtype, _balanced(2 * tokens, top_k, total)))
        return two - one

    # the balanced routing sends and receives tokens * top_k rows on each rank, as the plain module computes
    return (growth(split) - growth(experts)) // (tokens * top_k)


def measure_experts(
    found: tuple[str, nn.Module],
    block: nn.Module,
    router: type[nn.Module] | None,
    config: Any,
    expert_ffn: int,
    routing: dict[int, list[Tensor]],
    dtype: torch.dtype,
    repeats: Repeats,
    timeout_s: float,
) -> ExpertProfile:
    """Everything :class:`ExpertProfile` holds for one layer type (``expert_ffn``: from the model's constraints);
    ``routing``: rows per expert in each profiled forward of each of the type's layers
    (:func:`galva_profiler.routing.routing_by_layer`)."""
    from galva_comm.testing import run_distributed

    path, experts = found
    params = dict(experts.named_parameters(recurse=False))
    total = int(next(iter(params.values())).shape[0])
    top_k = int(getattr(config, "num_experts_per_tok", 0) or getattr(config, "top_k", 0) or 1)
    hidden = int(config.hidden_size)
    expert_bytes = sum(p.numel() for p in params.values()) * 4
    block_bytes = sum(p.numel() for p in block.parameters()) * 4 - expert_bytes
    expert_time, router_ms = time_experts(experts, block, router, hidden, dtype, repeats)
    rows = min(ROWS)
    one = saved_bytes(lambda: _call(experts, rows, hidden, dtype, _balanced(rows, top_k, total)))
    two = saved_bytes(lambda: _call(experts, 2 * rows, hidden, dtype, _balanced(2 * rows, top_k, total)))
    per_row = (two - one) / (rows * top_k)
    dispatch = 0.0
    if total % 2 == 0:
        ranks = run_distributed(_dispatch_worker, 2, experts, path, hidden, top_k, total, dtype, timeout=timeout_s)
        dispatch = max(0, max(ranks)) / 1.0
    imbalance, memory_imbalance = by_layer_and_summed(routing)
    return ExpertProfile(
        num_experts=total,
        top_k=top_k,
        expert_ffn=expert_ffn,
        expert_parameter_mib=expert_bytes / MIB,
        block_parameter_mib=max(0, block_bytes) / MIB,
        expert_time=expert_time,
        router_ms_per_token=router_ms,
        imbalance=imbalance,
        activation_mib_per_row=per_row / MIB,
        dispatch_activation_mib_per_row=dispatch / MIB,
        memory_imbalance=memory_imbalance,
        routed_tokens=int(next(iter(routing.values()))[0].sum()) // top_k,
    )
