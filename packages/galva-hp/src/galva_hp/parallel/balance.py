"""A router's load-balancing loss taken, as the single process takes it, over every layer and token of a micro-batch.

Mixtral's and the Qwen MoE families' auxiliary loss (Switch Transformer's) is one statistic per micro-batch:
``coef * E * sum_e (C_e / N) * (P_e / N)``, with ``C_e`` the top-k selections of expert ``e``, ``P_e`` the router
probability given to it and ``N`` the router rows, each summed over *all* layers and tokens. Under data, sequence and
pipeline parallelism those sums are spread over the ranks of a stage and over the stages, so no rank can form the
loss alone. It is not needed alone: ``C`` carries no gradient, so the gradient of the loss with respect to this
rank's ``P_e`` is ``coef * E * C_e / N**2`` with the *global* ``C`` and ``N`` — a vector, not a graph.

:class:`BalanceLedger` keeps, per micro-batch, each layer's ``(C, N)`` summed over its stage (one small all-reduce
when the layer runs), and puts that gradient into ``P`` when the layer's output gradient arrives
(:meth:`BalanceLedger.attach`). Stages other than this one add their sums: each stage sends its ``(C, N)`` of a
micro-batch to the other stages of its pipeline when its forward of the micro-batch is done, and reads theirs before
the micro-batch's backward (all of them ran their forward before it). The loss value itself (for the metrics) is one
all-reduce per iteration (:meth:`BalanceLedger.finish`).

Layers recomputed under activation checkpointing record again under the same key: the statistic is replaced, not
added twice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["BalanceLedger"]

_TAG_BASE = 1 << 20


class BalanceLedger:
    """Router statistics of one iteration (see the module docstring). ``experts``: E; ``coef``: the loss weight;
    ``whole``: this stage's group; ``pipeline``: this rank's pipeline (global ranks, stage order) and the group the
    statistics travel on (None when pp == 1)."""

    def __init__(
        self,
        experts: int,
        coef: float,
        micro_batches: int,
        whole: ProcessGroup | None,
        pipeline: tuple[tuple[int, ...], ProcessGroup] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.experts, self.coef, self.micro_batches = experts, coef, micro_batches
        self.whole, self.pipeline, self.device = whole, pipeline, torch.device(device)
        self.micro_batch = 0
        """The micro-batch running now (set by the runtime before each forward and backward)."""
        self._stage: dict[int, dict[str, Tensor]] = {}  # micro-batch -> layer key -> stage sum [C..., N]
        self._local: dict[int, dict[str, tuple[Tensor, Tensor]]] = {}  # -> key -> ([C..., N], P) of this rank
        self._others: dict[int, Tensor] = {}  # micro-batch -> the other stages' [C..., N]
        self._pending: list[tuple[Any, Tensor]] = []
        self._sent: dict[int, set[str]] = {}
        self._chunks_bound = 1024  # model chunks of a pipeline are far fewer

    def attach(self, output: Tensor, key: str, counts: Tensor, rows: int, probs: Tensor) -> Tensor:
        """Record layer ``key``'s statistics (``counts``: top-k selections per expert, ``rows``: router rows,
        ``probs``: probability per expert, differentiable) for the running micro-batch; returns ``output`` with
        the load-balancing gradient of ``probs`` attached to its backward."""
        k = self.micro_batch
        stats = torch.cat([counts.detach().double(), counts.new_tensor([rows]).double()]).to(self.device)
        self._local.setdefault(k, {})[key] = (stats, probs.detach().double())
        summed = stats.clone()
        if self.whole is not None and self.whole.size() > 1:
            dist.all_reduce(summed, group=self.whole)
        self._stage.setdefault(k, {})[key] = summed
        return _Attach.apply(output, probs, self, k)

    # ---------------------------------------------------------------------------------------------- pipeline
    def forward_done(self, k: int, chunk: int) -> None:
        """After this stage's forward of micro-batch ``k`` (model chunk ``chunk``): send its sums to the other
        stages."""
        if self.pipeline is None:
            return
        ranks, group = self.pipeline
        me = dist.get_rank()
        sent = self._sent.setdefault(k, set())
        total = torch.zeros(self.experts + 1, dtype=torch.float64, device=self.device)
        for key, stats in self._stage.get(k, {}).items():
            if key not in sent:  # this chunk's layers (an interleaved stage runs several chunks)
                total += stats
                sent.add(key)
        for rank in ranks:
            if rank != me:
                self._pending.append((dist.isend(total.clone(), rank, group=group, tag=self._tag(k, chunk)), total))

    def before_backward(self, k: int, num_chunks: int) -> None:
        """Before this stage's first backward of micro-batch ``k``: receive the other stages' sums."""
        self.micro_batch = k
        if self.pipeline is None or k in self._others:
            return
        ranks, group = self.pipeline
        me = dist.get_rank()
        pp = len(ranks)
        received = torch.zeros(self.experts + 1, dtype=torch.float64, device=self.device)
        for chunk in range(num_chunks):
            stage = chunk % pp
            if ranks[stage] == me:
                continue
            buffer = torch.empty_like(received)
            dist.recv(buffer, ranks[stage], group=group, tag=self._tag(k, chunk))
            received += buffer
        self._others[k] = received

    def _tag(self, k: int, chunk: int) -> int:
        """Tags of their own: the pipeline's activation messages use small ones (``2 * chunk + 1 or 2``)."""
        return _TAG_BASE + k * self._chunks_bound + chunk

    # ---------------------------------------------------------------------------------------------- values
    def _stage_total(self, k: int) -> Tensor:
        total = torch.zeros(self.experts + 1, dtype=torch.float64, device=self.device)
        for stats in self._stage.get(k, {}).values():
            total += stats
        return total

    def probs_grad(self, k: int) -> Tensor:
        """``d loss / d P`` for micro-batch ``k``: ``coef * E * C / (n * N**2)`` with the global ``C`` and ``N``."""
        total = self._stage_total(k) + self._others.get(k, 0.0)
        counts, rows = total[:-1], total[-1]
        return self.coef * self.experts * counts / (self.micro_batches * rows * rows)

    def finish(self) -> float:
        """The iteration's loss term, ``sum_k coef * E * sum_e C_e P_e / N**2 / n`` (collective over the world:
        every rank calls it, with or without layers of experts); clears the ledger."""
        for work, _ in self._pending:
            work.wait()
        n, e = self.micro_batches, self.experts
        flat = torch.zeros(n, 2 * e + 1, dtype=torch.float64, device=self.device)
        for k, layers in self._local.items():
            for stats, probs in layers.values():
                flat[k, : e + 1] += stats
                flat[k, e + 1 :] += probs
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        counts, rows, probs = flat[:, :e], flat[:, e], flat[:, e + 1 :]
        present = rows > 0
        per_batch = (counts * probs).sum(dim=1)[present] / (rows[present] * rows[present])
        self._stage.clear()
        self._local.clear()
        self._others.clear()
        self._pending.clear()
        self._sent.clear()
        return float(self.coef * e * per_batch.sum() / n)


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, output: Tensor, probs: Tensor, ledger: BalanceLedger, k: int) -> Tensor:
        ctx.ledger, ctx.k = ledger, k
        ctx.probs = (probs.dtype, probs.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        dtype, device = ctx.probs
        return grad, ctx.ledger.probs_grad(ctx.k).to(dtype=dtype, device=device), None, None
