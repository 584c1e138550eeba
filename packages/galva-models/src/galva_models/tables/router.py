"""A family's router load-balancing loss, taken by Galva as the family takes it: over every layer and token of a
micro-batch.

transformers' mixture-of-experts task models add ``router_aux_loss_coef * load_balancing_loss_func(router_logits,
num_experts, num_experts_per_tok)`` to the loss when ``output_router_logits`` is set, with the router logits the
base model records from its router modules (``_can_record_outputs["router_logits"]``: the router class and the
index of the logits in its output). The function is Switch Transformer's: softmax of each layer's logits, top-k
counts and probability sums over every layer's rows. :func:`router_loss` says whether a model has such a term (and
checks, on random logits, that the family's function is that statistic); :func:`watch_routers` hands each router's
statistics to galva-hp's :class:`~galva_hp.parallel.balance.BalanceLedger`, which sums them over ranks and stages.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor, nn

from galva_hp.parallel.balance import BalanceLedger

__all__ = ["router_class", "router_loss", "switch_statistics", "watch_routers"]


def router_class(base: nn.Module) -> tuple[type[nn.Module], int] | None:
    """``(router class, index of the logits in its output)`` from the base model's recorded outputs."""
    recorder = getattr(type(base), "_can_record_outputs", None) or {}
    entry = recorder.get("router_logits")
    if entry is None or getattr(entry, "target_class", None) is None:
        return None
    return entry.target_class, int(getattr(entry, "index", 0) or 0)


def switch_statistics(logits: Tensor, experts: int, top_k: int) -> tuple[Tensor, int, Tensor]:
    """``(counts, rows, probabilities)`` of one layer's router logits ``[rows, E]``: top-k selections per expert,
    the number of rows, and the probability per expert (differentiable), as ``load_balancing_loss_func`` takes
    them."""
    probs = torch.softmax(logits.reshape(-1, experts), dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=experts).to(torch.float64)
    return counts, probs.shape[0], probs.float().sum(dim=0)


def router_loss(model: Any) -> tuple[int, float] | None:
    """``(experts, coef)`` where the task model adds a load-balancing term to its loss; None where it adds none.
    Raises where it adds one that is not the Switch statistic (Galva would compute another loss)."""
    config = model.config
    coef = getattr(model, "router_aux_loss_coef", None)
    if not getattr(config, "output_router_logits", False) or not coef:
        return None
    router = router_class(model.base_model)
    if router is not None and not any(isinstance(m, router[0]) for m in model.modules()):
        return None  # a family with an optional router that this config leaves out (Doge without is_moe)
    family = importlib.import_module(type(model).__module__)
    function = getattr(family, "load_balancing_loss_func", None)
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if function is None or not experts or not top_k or router is None:
        raise ValueError(f"{config.model_type}: a router loss Galva cannot find the statistics of")
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(6, experts, generator=generator, dtype=torch.float64) for _ in range(3))
    try:
        theirs = float(function(logits, experts, top_k))
    except (TypeError, ValueError, RuntimeError, IndexError) as err:  # another router (product keys ...)
        raise ValueError(
            f"{config.model_type}: its load_balancing_loss_func is not the Switch statistic: {err}"
        ) from err
    stats = [switch_statistics(x, experts, top_k) for x in logits]
    counts = torch.stack([s[0] for s in stats]).sum(dim=0)
    rows = sum(s[1] for s in stats)
    probs = torch.stack([s[2].double() for s in stats]).sum(dim=0)
    ours = float(experts * (counts * probs).sum() / (rows * rows))
    if abs(ours - theirs) > 1e-5 * max(1.0, abs(theirs)):  # the family sums in fp32
        raise ValueError(f"{config.model_type}: its load_balancing_loss_func is not the Switch statistic Galva sums")
    return int(experts), float(coef)


def watch_routers(
    block: nn.Module, router: tuple[type[nn.Module], int], ledger: BalanceLedger, key: str, top_k: int
) -> None:
    """Each call of ``block`` reports its router's statistics to ``ledger`` under ``key`` and attaches their
    gradient to the block's output."""
    cls, index = router
    routers = [m for m in block.modules() if isinstance(m, cls)]
    if len(routers) != 1:
        raise ValueError(f"{key}: {len(routers)} routers of class {cls.__name__} in one block (expected 1)")
    seen: list[tuple[Tensor, int, Tensor]] = []

    def record(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        logits = out[index] if isinstance(out, (tuple, list)) else out
        seen.append(switch_statistics(logits, ledger.experts, top_k))

    def attach(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        counts, rows, probs = seen.pop()
        if isinstance(out, tuple):
            return (ledger.attach(out[0], key, counts, rows, probs), *out[1:])
        return ledger.attach(out, key, counts, rows, probs)

    routers[0].register_forward_hook(record)
    block.register_forward_hook(attach)
