"""The runtime model: this rank's stage of a model under a strategy, built by :func:`galva_hp.build.build`.

:class:`HybridParallelModel` runs one iteration's forwards and backwards with
:meth:`~HybridParallelModel.forward_backward` (the pipeline schedule over micro-batches; gradient reductions as the
cost model prices them: ddp buckets launched from the last micro-batch's backward, FSDP2 reduce-scatters in it,
tp-replicated parameters summed once per iteration), and hands the optimizer its parameters with
:meth:`~HybridParallelModel.param_records`.

Parameters read by several modules (the embedding-to-head tie, shared tables) are one mechanism,
:mod:`galva_hp.shared_params`: one set of optimizer states (the home stage's), their gradients summed once in
:meth:`~HybridParallelModel.finish_gradients`, the other stages' copies refreshed in
:meth:`~HybridParallelModel.after_step`; on one stage a tied weight is one tensor.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from galva_comm.groups import ProcessGroupCache
from galva_comm.layout import RankLayout
from galva_hp.activation_checkpoint import unwrapped_name
from galva_hp.batch import micro_batch, shard_for
from galva_hp.data_parallel import DataParallelUnit, DdpUnit, FsdpUnit, ParamRecord, all_reduce_flat, local_tensor
from galva_hp.grad_buckets import BucketReducer
from galva_hp.hooks import StepMetrics, saved_activation_meter
from galva_hp.labels import IGNORE_INDEX
from galva_hp.model import ParallelContext
from galva_hp.options import BuildOptions
from galva_hp.parallel.balance import BalanceLedger
from galva_hp.parallel.mappings import DeferredGradSums, defer_param_grad_sums
from galva_hp.parallel.rng import member_stream
from galva_hp.pipeline import PipelineStage, run_schedule, schedule_order
from galva_hp.precision import PrecisionPolicy
from galva_hp.shared_params import SharedParameters
from galva_schema import Strategy
from galva_schema.vocabulary import EMBEDDING_MODULE, layer_module, layer_of_module

__all__ = ["HybridParallelModel"]


class HybridParallelModel(nn.Module):
    """This rank's stage of a model under a strategy: modules, redistributions, data-parallel units, pipeline."""

    def __init__(
        self,
        strategy: Strategy,
        layout: RankLayout,
        groups: ProcessGroupCache,
        rank: int,
        options: BuildOptions,
        precision: PrecisionPolicy,
    ) -> None:
        super().__init__()
        self.strategy, self.layout, self.groups, self.rank = strategy, layout, groups, rank
        self.options, self.precision = options, precision
        self.stage = layout.stage_of(rank)
        self.embedding: nn.Module | None = None
        self.head: nn.Module | None = None
        self.layers = nn.ModuleDict()
        self.redistributions = nn.ModuleDict()
        self.units: list[DataParallelUnit] = []
        self.reducer: BucketReducer | None = None  # set by build() once every unit exists
        self.replicated = DeferredGradSums()  # parameters whose gradient is summed over tp once per iteration
        self.shared = SharedParameters()  # parameters read by several modules: this rank's copies (set by build())
        self._unit_tp: dict[str, int] = {}  # unit name -> tp degree of its module
        self._tp_partitioned: dict[str, set[str]] = {}  # unit name -> parameter names split over tp
        self.saved_bytes: dict[str, int] = {}
        self.contexts: dict[str, ParallelContext] = {}  # unit name -> the context its module was converted with
        self.replica_index: dict[str, int] = {}  # unit name -> this rank's data-parallel replica (where several)
        self.ledger: BalanceLedger | None = None  # router statistics over every layer (set by build() where needed)
        pipeline = next(p for p in layout.pipelines if rank in p)
        self.pipe = PipelineStage(
            stage=self.stage,
            num_stages=strategy.pp,
            group=groups.get(pipeline) if len(pipeline) > 1 else None,
            ranks=tuple(pipeline),
            num_chunks=strategy.num_chunks,
            device=torch.device(options.device),
        )

    # ------------------------------------------------------------------------------------------------ structure
    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.strategy.pp - 1

    def layer_indices(self) -> tuple[int, ...]:
        return self.strategy.stage_layers(self.stage)

    def param_records(self) -> list[ParamRecord]:
        """The optimizer's parameters on this rank, with the replication used for the global gradient norm."""
        records = []
        followers = self.shared.followers()  # a shared weight's copy off its home stage: the home's states only
        for unit in self.units:
            tp = self._unit_tp[unit.name]
            for name, param in unit.master_parameters():
                if id(param) in followers:
                    continue
                tp_replicas = 1 if name in self._tp_partitioned[unit.name] else tp
                records.append(
                    ParamRecord(name=f"{unit.name}.{name}", param=param, replicas=unit.replicas_over_dp() * tp_replicas)
                )
        return records + self.shared.records()

    def local_state(self) -> dict[str, Tensor]:
        """fp32 master parameters of this rank, gathered over data parallelism (tp shards stay shards)."""
        out = {}
        for record in self.param_records():
            p = record.param.detach()
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[unwrapped_name(record.name)] = full.clone()
        return out

    # --------------------------------------------------------------------------------------------------- running
    def chunk_units(self, chunk: int) -> list[DataParallelUnit]:
        """The data-parallel units of model chunk ``chunk`` (embedding in chunk 0, head in the last one)."""
        chunk_of = self.strategy.layer_chunks
        last = self.strategy.num_chunks - 1

        def of(name: str) -> int:
            index = layer_of_module(name)
            return 0 if name == EMBEDDING_MODULE else last if index is None else chunk_of[index]

        return [u for u in self.units if of(u.name) == chunk]

    def _chunk_forward(self, chunk: int, received: Tensor | None, ids: Tensor | None, labels: Tensor | None) -> Any:
        hidden = received
        if chunk == 0 and self.embedding is not None:
            assert ids is not None
            if ids.is_floating_point():  # pixels (any non-token input) enter in the compute dtype, in every plan
                ids = ids.to(self.precision.param_dtype)
            hidden = self._run("embedding", self.embedding, ids)
        for index in self.strategy.chunk_layers(chunk):
            key = str(index)
            if key in self.redistributions:
                hidden = self.redistributions[key](hidden)
            hidden = self._run(layer_module(index), self.layers[key], hidden)
        if chunk != self.strategy.num_chunks - 1 or self.head is None:
            return hidden
        key = str(self.strategy.num_layers)
        if key in self.redistributions:
            hidden = self.redistributions[key](hidden)
        return self._run("head", self.head, hidden, labels)

    def _run(self, name: str, module: nn.Module, *args: Any) -> Any:
        replica = self.replica_index.get(name)
        streams = member_stream(replica, self.pipe.device) if replica is not None and module.training else None
        with streams or contextlib.nullcontext():  # dropout masks of this replica's samples
            if not self.options.measure_activations:
                return module(*args)
            with saved_activation_meter() as meter:
                out = module(*args)
        self.saved_bytes[name] = self.saved_bytes.get(name, 0) + meter.bytes
        return out

    def forward_backward(self, input_ids: Tensor, labels: Tensor) -> StepMetrics:
        """One iteration's forwards and backwards on the global batch ``[batch, seq]``; gradients end up reduced.

        Every rank passes the same global batch. Returns the mean token loss over the global batch (the same number
        on every rank) and the number of tokens.
        """
        strategy, n = self.strategy, self.strategy.num_micro_batches
        if input_ids.shape[0] != strategy.global_batch_size:
            raise ValueError(
                f"batch has {input_ids.shape[0]} samples but global_batch_size is {strategy.global_batch_size}"
            )
        tokens = int((labels != IGNORE_INDEX).sum())
        first, last = self.layout.vocab_first.activation, self.layout.vocab_last.activation
        # each part goes to the device alone, a tensor of its own: the embedding saves its input for the backward,
        # and a view would keep the whole global batch there (a ViT's pixels: every data-parallel rank's images)
        device = self.options.device
        ids_parts = [
            shard_for(micro_batch(input_ids, k, n), first, self.rank, strategy.vocab.sp).to(device, copy=True)
            if self.is_first
            else None
            for k in range(n)
        ]
        per_token = labels.dim() > 1  # image labels are one per sample: never split along a sequence
        label_parts = [
            shard_for(micro_batch(labels, k, n), last, self.rank, last.seq_sharded and per_token, context=per_token).to(
                device, copy=True
            )
            if self.is_last
            else None
            for k in range(n)
        ]
        self.saved_bytes.clear()

        hooks = _StageHooks(self, ids_parts, label_parts, tokens)
        order = schedule_order(strategy.pipeline_schedule, self.stage, strategy.pp, n, strategy.virtual_stages)
        # what fixes a micro-batch's activation shapes under this plan, known on every stage: its inputs' shapes
        shape_keys = [
            (tuple(micro_batch(input_ids, k, n).shape), input_ids.dtype, tuple(micro_batch(labels, k, n).shape))
            for k in range(n)
        ]
        with defer_param_grad_sums(self.replicated):
            outputs = run_schedule(self.pipe, order, hooks, shape_keys)
        self.finish_gradients()
        totals = torch.zeros(2, dtype=torch.float64, device=self.options.device)
        for loss_sum, count in outputs:
            totals[0] += float(loss_sum.detach())
            totals[1] += float(count)
        if dist.get_world_size() > 1:
            dist.all_reduce(totals)
        loss = float(totals[0]) / max(float(totals[1]), 1.0)
        if self.ledger is not None:  # the load-balancing term, over every layer, rank and stage of each micro-batch
            loss += self.ledger.finish()
        return StepMetrics(loss=loss, tokens=tokens)

    def finish_gradients(self) -> None:
        """After the schedule: wait for the ddp reductions (launched during the last backward), sum the gradients of
        tp-replicated parameters over their groups, then those of the shared parameters' copies."""
        if self.reducer is not None:
            self.reducer.finish()
        self._sum_replicated_grads()
        self.shared.reduce_grads()

    def _sum_replicated_grads(self) -> None:
        """Once per iteration: sum over its group the gradient of every parameter that forward passed through
        ``differentiable_copy_to_group`` (Megatron-SP norms, row-parallel biases, replicated K/V), after the
        data-parallel reduction (the two sums commute). The gradient lives on the master (ddp) or the local shard
        (zero2/zero3)."""
        masters = {id(p): m for u in self.units if isinstance(u, DdpUnit) for p, m in u.grads_to_reduce()}
        shards = [u for u in self.units if isinstance(u, FsdpUnit)]
        by_group: dict[int, tuple[dist.ProcessGroup, list[Tensor]]] = {}
        for param, group in self.replicated.params.values():
            owner = masters.get(id(param))
            if owner is None:
                owner = next((s for u in shards if (s := u.sharded_parameter(param)) is not None), None)
            if owner is None or owner.grad is None:
                continue
            by_group.setdefault(id(group), (group, []))[1].append(local_tensor(owner.grad))
        for group, grads in by_group.values():
            all_reduce_flat(grads, group, grads[0].dtype)

    def after_step(self) -> None:
        """Hand the shared parameters' copies off their home stage the home value, then refresh compute weights from
        the master weights (bf16 ddp units)."""
        self.shared.sync()
        for unit in self.units:
            unit.after_step()

    def sync_shared_weights(self) -> None:
        """Give every shared parameter's copies, and the compute weights, their masters' values (after a build or a
        load: :meth:`after_step`)."""
        self.after_step()


class _StageHooks:
    """One iteration's :class:`~galva_hp.pipeline.ScheduleHooks`: chunk forwards on the micro-batch shards, and the
    data-parallel units of each chunk told when its gradients are complete (a chunk's last ``B`` or ``W``)."""

    def __init__(
        self, model: HybridParallelModel, ids: list[Tensor | None], labels: list[Tensor | None], tokens: int
    ) -> None:
        self.model, self.ids, self.labels, self.tokens = model, ids, labels, tokens
        self.units = {c: model.chunk_units(c) for c in model.strategy.stage_chunks(model.stage)}

    def forward(self, chunk: int, received: Tensor | None, k: int) -> Any:
        ledger = self.model.ledger
        if ledger is not None:
            ledger.micro_batch = k
        out = self.model._chunk_forward(chunk, received, self.ids[k], self.labels[k])
        if ledger is not None:
            ledger.forward_done(k, chunk)
        return out

    def _backward_of(self, k: int) -> None:
        ledger = self.model.ledger
        if ledger is not None:  # a recomputed (checkpointed) layer records under this micro-batch
            ledger.before_backward(k, self.model.strategy.num_chunks)

    def loss(self, out: Any) -> Tensor:
        return out[0] / max(self.tokens, 1)

    def before_backward(self, chunk: int, k: int, final: bool, split: bool) -> None:
        self._backward_of(k)
        if split:  # FSDP2 units were told at the input pass; their parameters must be gathered for the weight pass
            for unit in self.units[chunk]:
                unit.before_weight_backward()
            return
        reducer = self.model.reducer
        if final and reducer is not None:
            reducer.arm(self.units[chunk])  # this backward finishes the chunk's gradients: reduce as they become final
        for unit in self.units[chunk]:
            unit.before_backward(final)

    def after_backward(self, chunk: int, k: int, final: bool, split: bool) -> None:
        for unit in self.units[chunk]:
            unit.after_backward(final)
            if split and (final or unit.reduce_every_micro_batch):
                unit.finish_split_backward()
        reducer = self.model.reducer
        if split and final and reducer is not None:
            reducer.launch(self.units[chunk])

    def before_input_backward(self, chunk: int, k: int) -> None:
        self._backward_of(k)
        for unit in self.units[chunk]:
            unit.begin_split_backward()
