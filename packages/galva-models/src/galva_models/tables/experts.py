"""Expert parallelism in place, from transformers' expert-parallel table (``base_model_ep_plan``).

The table names, per layer, the module that holds every routed expert (style ``ep_dispatch_experts``, e.g.
``mlp.experts``). transformers gives every such module one interface: stacked expert weights whose first dimension
is the expert (``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``, optional biases; ``is_transposed`` swaps the last
two) and ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``. The router, shared experts
and everything else of the block stay the family's own code. In a layer's expert layout:

- ep: the module keeps ``E / ep`` experts (this rank's contiguous run) and its forward becomes dispatch / compute /
  combine: each (token, expert) assignment is sent to the rank holding the expert by one all-to-all with uneven
  splits, the family's own forward runs there on the received rows (one assignment per row, its top-k weight
  applied as the family applies it), and a second all-to-all brings the rows back, summed per token in the
  single-process order (by expert). Dropless: every assignment is computed.
- etp: each expert's FFN is split (the fused gate/up projection by output features, each of its two blocks on its
  own; the down projection by input features); the rows an etp group received are gathered over it, each rank
  computes its part of every row, and the parts are summed back to the rank that received the row.
- the block (the experts' parent) sees distinct tokens on every rank of the stage: under plain tp, whose ranks hold
  the same tokens, it takes this rank's ``1/tp`` of the sequence and gathers its output (its router and shared
  experts, replicated, then have their gradient summed over tp by the caller).

Every expert parameter is marked ``galva_expert`` (galva-hp gives it a data-parallel unit over the layer's expert
data-parallel group) and tagged with its :class:`~.sharding.Split` (the ep one; under both degrees the etp one
too, as ``galva_split_inner``, gathered first).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.parallel.mappings import (
    all_to_all_uneven,
    differentiable_all_to_all_uneven,
    differentiable_gather_replicated,
    differentiable_split,
    group_rank,
    group_size,
)
from galva_models.tables.sharding import Split

__all__ = ["EXPERTS_STYLE", "expert_paths", "split_experts"]

EXPERTS_STYLE = "ep_dispatch_experts"
SEQ_DIM = 1


def expert_paths(ep_table: dict[str, str]) -> list[str]:
    """Paths inside one layer of the modules holding the routed experts."""
    return [path for path, style in ep_table.items() if style == EXPERTS_STYLE]


def _etp_dim(name: str, param: Tensor, transposed: bool) -> tuple[int, int] | None:
    """``(dim, blocks)`` along which ``etp`` splits a stacked expert parameter (None: replicated over etp)."""
    if name.startswith("gate_up_proj"):
        if param.dim() == 2:  # its bias [E, 2F]
            return 1, 2
        return (2 if transposed else 1), 2
    if name == "down_proj":
        return (1 if transposed else 2), 1
    return None


def _part(tensor: Tensor, dim: int, parts: int, index: int, blocks: int) -> Tensor:
    pieces = [b.chunk(parts, dim=dim)[index] for b in tensor.chunk(blocks, dim=dim)]
    return torch.cat(pieces, dim=dim).detach().clone()


def split_experts(experts: nn.Module, path: str, ep_group: ProcessGroup | None, etp_group: ProcessGroup | None) -> None:
    """Keep this rank's experts (``ep_group``) and its part of each (``etp_group``) in ``experts``, in place, and
    make its forward dispatch and combine (see the module docstring)."""
    ep, etp = group_size(ep_group), group_size(etp_group)
    total = int(getattr(experts, "num_experts", 0) or next(experts.parameters()).shape[0])
    if total % ep:
        raise ValueError(f"{path}: ep {ep} does not divide its {total} experts")
    transposed = bool(getattr(experts, "is_transposed", False))
    if not getattr(experts, "is_concatenated", True) and etp > 1:
        raise ValueError(f"{path}: etp needs the gate and up projections concatenated, not interleaved")
    local = total // ep
    first = group_rank(ep_group) * local
    for name, param in list(experts.named_parameters(recurse=False)):
        value = param.detach().narrow(0, first, local)
        split = Split(0, ep_group, total) if ep_group is not None else None
        inner: Split | None = None
        along = _etp_dim(name, param, transposed)
        if etp > 1:
            if along is None:
                raise ValueError(f"{path}.{name}: etp does not know how to split it (a bias added after the sum)")
            dim, blocks = along
            if value.shape[dim] % (etp * blocks):
                raise ValueError(f"{path}.{name}: {value.shape[dim]} features do not split over etp {etp}")
            full = value.shape[dim]
            value = _part(value, dim, etp, group_rank(etp_group), blocks)
            inner = Split(dim, etp_group, full, blocks) if etp_group is not None else None
        new = nn.Parameter(value.clone(), requires_grad=param.requires_grad)
        new.galva_expert = True  # type: ignore[attr-defined]
        if inner is not None and split is None:
            split, inner = inner, None
        if split is not None:
            new.galva_split = split  # type: ignore[attr-defined]
        if inner is not None:  # gathered first (within the experts this rank's ep part holds)
            new.galva_split_inner = inner  # type: ignore[attr-defined]
        setattr(experts, name, new)
    if hasattr(experts, "num_experts"):
        experts.num_experts = local  # type: ignore[assignment]
    family_forward = type(experts).forward
    experts.forward = types.MethodType(_dispatching(family_forward, total, ep_group, etp_group), experts)


def _dispatching(inner: Any, total: int, ep_group: ProcessGroup | None, etp_group: ProcessGroup | None) -> Any:
    ep = group_size(ep_group)
    local = total // ep

    def forward(self: nn.Module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments by expert: the single-process summation order
        token = order // top_k
        per_expert = torch.bincount(flat, minlength=total)
        send = per_expert.view(ep, local).sum(dim=1).tolist()
        # what each source sends to each of this rank's experts
        arriving = all_to_all_uneven(per_expert.view(ep, local), [1] * ep, [1] * ep, ep_group)
        receive = arriving.sum(dim=1).tolist()
        rows = differentiable_all_to_all_uneven(hidden[token], send, receive, ep_group)
        chosen = top_k_weights.reshape(-1)[order].unsqueeze(1)
        weights = differentiable_all_to_all_uneven(chosen, send, receive, ep_group)
        ids = torch.arange(local, device=hidden.device).repeat(ep).repeat_interleave(arriving.reshape(-1))
        out = _compute(self, inner, rows, ids, weights, etp_group)
        back = differentiable_all_to_all_uneven(out, receive, send, ep_group)
        combined = torch.zeros_like(hidden)
        return combined.index_add(0, token, back.to(combined.dtype))

    return forward


def _compute(
    module: nn.Module, inner: Any, rows: Tensor, ids: Tensor, weights: Tensor, etp_group: ProcessGroup | None
) -> Tensor:
    """The family's own expert computation on received rows (one assignment each); under etp, on every row of the
    etp group with this rank's part of each expert, the parts summed back to the row's owner."""
    etp = group_size(etp_group)
    if etp == 1:
        return inner(module, rows, ids.unsqueeze(1), weights.to(rows.dtype))
    mine = rows.shape[0]
    sizes = all_to_all_uneven(torch.tensor([[mine]] * etp, device=rows.device), [1] * etp, [1] * etp, etp_group)
    sizes_list = sizes.reshape(-1).tolist()
    every = [mine] * etp

    def gather(x: Tensor) -> Tensor:
        return differentiable_all_to_all_uneven(x.repeat(etp, *([1] * (x.dim() - 1))), every, sizes_list, etp_group)

    all_ids = all_to_all_uneven(ids.repeat(etp), every, sizes_list, etp_group)
    partial = inner(module, gather(rows), all_ids.unsqueeze(1), gather(weights).to(rows.dtype))
    parts = differentiable_all_to_all_uneven(partial, sizes_list, every, etp_group)
    # the width named: a rank that received no rows (dropless routing can send it none) has 0 elements to view
    return parts.view(etp, mine, *partial.shape[1:]).sum(dim=0)


def distinct_tokens(block: nn.Module, tp_group: ProcessGroup) -> None:
    """Under plain tp (the block's input replicated over ``tp_group``), the block computes this rank's ``1/tp`` of
    the sequence and its output is gathered back, so every rank of the stage routes distinct tokens."""

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if args:
            return (differentiable_split(args[0], SEQ_DIM, tp_group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": differentiable_split(kwargs["hidden_states"], SEQ_DIM, tp_group)}

    def leave(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        if isinstance(out, tuple):
            return (differentiable_gather_replicated(out[0], SEQ_DIM, tp_group), *out[1:])
        return differentiable_gather_replicated(out, SEQ_DIM, tp_group)

    block.register_forward_pre_hook(enter, with_kwargs=True)
    block.register_forward_hook(leave, with_kwargs=True)
