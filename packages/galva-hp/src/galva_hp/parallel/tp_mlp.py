"""Megatron tensor-parallel MLP (GELU or gated), made from the single-process weights."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.parallel.gather_state import param_or_grad
from galva_hp.parallel.mappings import (
    all_gather_along_dim,
    group_rank,
    group_size,
)
from galva_hp.parallel.tp_regions import column_parallel_linear, enter_tp_region, row_output, row_parallel_linear, shard

__all__ = ["TensorParallelMLP"]


class TensorParallelMLP(nn.Module):
    """Megatron tensor-parallel MLP: ``down(activation(*[up_i(x)]))`` with all ``up_i`` fused in one
    column-parallel layer (local rows ``[up_0 shard; up_1 shard; ...]``) and ``down`` row-parallel.

    GELU MLP: ``up_weights=[fc_in]``, ``activation=F.gelu``. SwiGLU: ``up_weights=[gate, up]``,
    ``activation=lambda g, u: F.silu(g) * u``.
    """

    def __init__(
        self,
        up_weights: Sequence[Tensor],
        up_biases: Sequence[Tensor | None],
        down_weight: Tensor,
        down_bias: Tensor | None,
        activation: Callable[..., Tensor],
        *,
        group: ProcessGroup,
        sequence_parallel: bool = False,
        names: tuple[Sequence[str], str] | None = None,
    ) -> None:
        super().__init__()
        # single-process names of the projections, for gather_full
        self.names = names or ([f"up.{i}" for i in range(len(up_weights))], "down")
        tp, rank = group_size(group), group_rank(group)
        self.group, self.sequence_parallel, self.activation = group, sequence_parallel, activation
        rows = [shard(w, 0, rank, tp) for w in up_weights]
        self.local_sizes = [r.shape[0] for r in rows]
        has_bias = up_biases[0] is not None
        bias = torch.cat([shard(b, 0, rank, tp) for b in up_biases if b is not None]) if has_bias else None
        self.up = column_parallel_linear(torch.cat(rows).detach(), bias, up_weights[0].shape[1], group)
        self.down = row_parallel_linear(shard(down_weight, 1, rank, tp).detach(), down_bias, group)

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        """Full single-process tensors (named by ``names``) assembled over the tp group, or their gradients."""
        up_names, down_name = self.names
        full: dict[str, Tensor] = {}
        weights = param_or_grad(self.up.weight, grads).split(self.local_sizes)
        biases = None if self.up.bias is None else param_or_grad(self.up.bias, grads).split(self.local_sizes)
        for i, name in enumerate(up_names):
            full[f"{name}.weight"] = all_gather_along_dim(weights[i], 0, self.group)
            if biases is not None:
                full[f"{name}.bias"] = all_gather_along_dim(biases[i], 0, self.group)
        full[f"{down_name}.weight"] = all_gather_along_dim(param_or_grad(self.down.weight, grads), 1, self.group)
        if self.down.bias is not None:
            full[f"{down_name}.bias"] = param_or_grad(self.down.bias, grads)
        return full

    def forward(self, x: Tensor) -> Tensor:
        x = enter_tp_region(x, self.group, self.sequence_parallel)
        parts = self.up(x)[0].split(self.local_sizes, dim=-1)
        return row_output(self.down, self.activation(*parts), self.sequence_parallel)
