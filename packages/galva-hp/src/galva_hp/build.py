"""Build this rank's part of a :class:`~galva_hp.model.LayeredModel` under a :class:`~galva_schema.Strategy`.

:func:`build` does, in order:

1. validate the plan against the model, the world and the sequence length (before any process group exists);
2. create every process group of the plan through a :class:`~galva_comm.groups.ProcessGroupCache`, in
   :meth:`~galva_comm.layout.RankLayout.all_groups` order (one communicator per distinct rank tuple);
3. keep only this rank's pipeline stage; materialise meta modules one at a time (deferred init);
4. convert each module with the model's parallelizer and a :class:`~galva_hp.model.ParallelContext` of its layer;
5. wrap activation checkpointing, then data parallelism (ddp / zero2 / zero3 over the layer's sharding group);
6. insert a redistribution wherever a layer's input layout differs from its predecessor's output layout;
7. tie the embedding and head copies of shared weights (one rank when pp == 1, the tie group otherwise).

The result, :class:`HybridParallelModel`, runs one iteration's forwards and backwards with
:meth:`~HybridParallelModel.forward_backward` and hands the optimizer its parameters with
:meth:`~HybridParallelModel.param_records`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from galva_comm.groups import ProcessGroupCache
from galva_comm.layout import LayerGroups, RankLayout, RedistributionPlan
from galva_hp.activation_checkpoint import Checkpointed
from galva_hp.batch import micro_batch, shard_for
from galva_hp.data_parallel import DataParallelUnit, DdpUnit, FsdpUnit, ParamRecord, all_reduce_flat, local_tensor, wrap
from galva_hp.deferred_init import InitFn, is_meta, materialize
from galva_hp.grad_buckets import BucketReducer
from galva_hp.hooks import StepMetrics, saved_activation_meter
from galva_hp.model import LayeredModel, ParallelContext
from galva_hp.parallel.mappings import DeferredGradSums, defer_param_grad_sums
from galva_hp.parallel.redistribute import Redistribute
from galva_hp.pipeline import PipelineStage, run_schedule
from galva_hp.plan_check import check_plan
from galva_hp.precision import PrecisionPolicy
from galva_schema import GroupKind, Strategy

__all__ = ["BuildOptions", "HybridParallelModel", "build", "check_plan"]


@dataclass(frozen=True)
class BuildOptions:
    """Runtime choices that are not part of the plan.

    - ``seq_len``: the training sequence length, checked against every sequence-sharding degree at build time.
    - ``reduce_in_fp32``: reduce gradients in fp32 under bf16 (else in bf16).
    - ``reduce_every_micro_batch``: reduce gradients after every micro-batch backward instead of once per
      iteration (less memory for accumulated full gradients, more traffic).
    - ``ignore_index``: label value that does not count as a token.
    - ``init_fn``: initialiser for modules built on the meta device (see :mod:`galva_hp.deferred_init`).
    - ``measure_activations``: record the bytes autograd saves per layer (``HybridParallelModel.saved_bytes``).
    - ``device``: where this rank's modules, batches and communication buffers live (``"cpu"`` with gloo,
      ``"cuda:<local rank>"`` with NCCL).
    """

    seq_len: int | None = None
    reduce_in_fp32: bool = True
    reduce_every_micro_batch: bool = False
    ignore_index: int = -100
    init_fn: InitFn | None = None
    measure_activations: bool = False
    device: str = "cpu"


# ----------------------------------------------------------------------------------------------------- the model
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
        self._unit_tp: dict[str, int] = {}  # unit name -> tp degree of its module
        self._tp_partitioned: dict[str, set[str]] = {}  # unit name -> parameter names split over tp
        self._ties: list[tuple[nn.Parameter | None, nn.Parameter | None, dist.ProcessGroup | None, int]] = []
        self.saved_bytes: dict[str, int] = {}
        self.contexts: dict[str, ParallelContext] = {}  # unit name -> the context its module was converted with
        pipeline = next(p for p in layout.pipelines if rank in p)
        self.pipe = PipelineStage(
            stage=self.stage,
            num_stages=strategy.pp,
            group=groups.get(pipeline) if len(pipeline) > 1 else None,
            prev_rank=pipeline[self.stage - 1] if self.stage > 0 else None,
            next_rank=pipeline[self.stage + 1] if self.stage < strategy.pp - 1 else None,
            device=torch.device(options.device),
        )

    # ------------------------------------------------------------------------------------------------ structure
    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.strategy.pp - 1

    def layer_indices(self) -> range:
        return self.strategy.stage_layers(self.stage)

    def param_records(self) -> list[ParamRecord]:
        """The optimizer's parameters on this rank, with the replication used for the global gradient norm."""
        records = []
        skipped = {id(head) for _, head, _, _ in self._ties if head is not None}
        for unit in self.units:
            tp = self._unit_tp[unit.name]
            for name, param in unit.master_parameters():
                tp_replicas = 1 if name in self._tp_partitioned[unit.name] else tp
                records.append(
                    ParamRecord(
                        name=f"{unit.name}.{name}",
                        param=param,
                        replicas=unit.replicas_over_dp() * tp_replicas,
                        counted=id(param) not in skipped,
                    )
                )
        return records

    def local_state(self) -> dict[str, Tensor]:
        """fp32 master parameters of this rank, gathered over data parallelism (tp shards stay shards)."""
        out = {}
        for record in self.param_records():
            p = record.param.detach()
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[record.name.replace(".inner.", ".")] = full.clone()
        return out

    # --------------------------------------------------------------------------------------------------- running
    def _stage_forward(self, received: Tensor | None, ids: Tensor | None, labels: Tensor | None) -> Any:
        hidden = received
        if self.embedding is not None:
            hidden = self._run("embedding", self.embedding, ids)
        for index in self.layer_indices():
            key = str(index)
            if key in self.redistributions:
                hidden = self.redistributions[key](hidden)
            hidden = self._run(f"layers.{index}", self.layers[key], hidden)
        if self.head is None:
            return hidden
        key = str(self.strategy.num_layers)
        if key in self.redistributions:
            hidden = self.redistributions[key](hidden)
        return self._run("head", self.head, hidden, labels)

    def _run(self, name: str, module: nn.Module, *args: Any) -> Any:
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
        tokens = int((labels != self.options.ignore_index).sum())
        input_ids, labels = input_ids.to(self.options.device), labels.to(self.options.device)
        first, last = self.layout.vocab_first.activation, self.layout.vocab_last.activation
        ids_parts = [
            shard_for(micro_batch(input_ids, k, n), first, self.rank, strategy.vocab.sp) if self.is_first else None
            for k in range(n)
        ]
        label_parts = [
            shard_for(micro_batch(labels, k, n), last, self.rank, last.seq_sharded) if self.is_last else None
            for k in range(n)
        ]
        self.saved_bytes.clear()

        def forward(received: Tensor | None, k: int) -> Any:
            return self._stage_forward(received, ids_parts[k], label_parts[k])

        def before_backward(k: int, sync: bool) -> None:
            if sync and self.reducer is not None:
                self.reducer.arm()  # this backward finishes the gradients: reduce them as they become final
            for unit in self.units:
                unit.before_backward(sync)

        def after_backward(k: int, sync: bool) -> None:
            for unit in self.units:
                unit.after_backward(sync)

        with defer_param_grad_sums(self.replicated):
            outputs = run_schedule(
                self.pipe,
                strategy.pipeline_schedule,
                n,
                forward,
                loss_of=lambda out: out[0] / max(tokens, 1),
                before_backward=before_backward,
                after_backward=after_backward,
            )
        self.finish_gradients()
        totals = torch.zeros(2, dtype=torch.float64, device=self.options.device)
        for loss_sum, count in outputs:
            totals[0] += float(loss_sum.detach())
            totals[1] += float(count)
        if dist.get_world_size() > 1:
            dist.all_reduce(totals)
        return StepMetrics(loss=float(totals[0]) / max(float(totals[1]), 1.0), tokens=tokens)

    def finish_gradients(self) -> None:
        """After the schedule: wait for the ddp reductions (launched during the last backward), sum the gradients of
        tp-replicated parameters over their groups, then add up the tied copies."""
        if self.reducer is not None:
            self.reducer.finish()
        self._sum_replicated_grads()
        for emb, head, group, _ in self._ties:
            if emb is not None and head is not None:  # both copies on this rank (pp == 1)
                ge, gh = _grad_or_zero(emb), _grad_or_zero(head)
                total = ge + gh
                ge.copy_(total)
                gh.copy_(total)
            else:
                param = emb if emb is not None else head
                assert param is not None
                dist.all_reduce(_grad_or_zero(param), group=group)

    def _sum_replicated_grads(self) -> None:
        """Once per iteration: sum over its group the gradient of every parameter that forward passed through
        ``copy_to_group`` (Megatron-SP norms, row-parallel biases, replicated K/V), after the data-parallel reduction
        (the two sums commute). The gradient lives on the master (ddp) or the local shard (zero2/zero3)."""
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
        """Refresh compute weights from the master weights (bf16 ddp units)."""
        for unit in self.units:
            unit.after_step()

    def sync_tied_weights(self) -> None:
        """Make the head copy of every tied weight equal to the embedding copy."""
        with torch.no_grad():
            for emb, head, group, src in self._ties:
                if emb is not None and head is not None:
                    local_tensor(head).copy_(local_tensor(emb))
                else:
                    param = emb if emb is not None else head
                    assert param is not None
                    dist.broadcast(local_tensor(param.data), src=src, group=group)
        self.after_step()


def _grad_or_zero(param: nn.Parameter) -> Tensor:
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return local_tensor(param.grad)


# --------------------------------------------------------------------------------------------------------- build
def build(model: LayeredModel, strategy: Strategy, options: BuildOptions | None = None) -> HybridParallelModel:
    """Build this rank's part of ``model`` under ``strategy`` (collective: every rank of the world calls it)."""
    options = options or BuildOptions()
    if not dist.is_initialized():
        raise RuntimeError("build() needs torch.distributed to be initialised (torchrun, or run_distributed in tests)")
    rank, world = dist.get_rank(), dist.get_world_size()
    check_plan(model, strategy, world, options.seq_len)
    _separate_tied_copies(model)
    precision = PrecisionPolicy.from_precision(strategy.mixed_precision, options.reduce_in_fp32)

    layout = RankLayout(strategy)
    groups = ProcessGroupCache()
    groups.create_for_layout(layout)  # includes the groups of every boundary's forward and backward exchange

    out = HybridParallelModel(strategy, layout, groups, rank, options, precision)
    parallelizer = model.parallelizer
    if out.is_first:
        ctx = _context(layout.vocab_first, rank, groups, strategy.megatron_sp, strategy.vocab.sp)
        module = _convert("embedding", model.embedding, options, lambda m: parallelizer.embedding(m, ctx))
        out.embedding = _wrap(out, "embedding", module, layout.vocab_first, ctx, False)
    for index in out.layer_indices():
        name, layer_type = f"layers.{index}", model.layer_types[index]
        ctx = _context(layout.layers[index], rank, groups, strategy.megatron_sp, False)
        convert = partial(parallelizer.layer, layer_type=layer_type, ctx=ctx)
        module = _convert(name, model.layers[index], options, convert)
        checkpoint = strategy.layers[index].checkpoint
        out.layers[str(index)] = _wrap(out, name, module, layout.layers[index], ctx, checkpoint, index)
    if out.is_last:
        ctx = _context(layout.vocab_last, rank, groups, strategy.megatron_sp, strategy.vocab.sp)
        module = _convert("head", model.head, options, lambda m: parallelizer.head(m, ctx))
        out.head = _wrap(out, "head", module, layout.vocab_last, ctx, False)
    for index, plan in layout.boundary_plans():
        if rank in plan.target.ranks:
            out.redistributions[str(index)] = _redistribution(plan, groups, rank)
    out.reducer = BucketReducer([u for u in out.units if isinstance(u, DdpUnit)])
    _tie(out, model.tied_weights)
    out.sync_tied_weights()
    return out


def _convert(
    name: str, module: nn.Module, options: BuildOptions, parallel_form: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    """The parallel form of one module. A meta module is materialised for the conversion only and put back on the
    meta device afterwards, so the full single-process weights never outlive their own conversion."""
    was_meta = is_meta(module)
    module = materialize(name, module, options.init_fn, options.device)
    converted = parallel_form(module)
    if was_meta and converted is not module:
        module.to_empty(device="meta")
    return converted.to(options.device)


def _context(
    groups: LayerGroups, rank: int, cache: ProcessGroupCache, megatron_sp: bool, vocab_sp: bool
) -> ParallelContext:
    tp, sp = groups.of(GroupKind.TP, rank), groups.of(GroupKind.SP, rank)
    return ParallelContext(
        tp_group=cache.get(tp) if len(tp) > 1 else None,
        sp_group=cache.get(sp) if len(sp) > 1 else None,
        megatron_sp=megatron_sp,
        vocab_sp=vocab_sp,
    )


def _wrap(
    out: HybridParallelModel,
    name: str,
    module: nn.Module,
    groups: LayerGroups,
    ctx: ParallelContext,
    checkpoint: bool,
    index: int | None = None,
) -> nn.Module:
    if checkpoint:
        module = Checkpointed(module)
    strategy = out.strategy
    dp_type = strategy.vocab_dp_type if index is None else strategy.layer_dp_type(index)
    shard = groups.of(GroupKind.SHARD, out.rank)
    out._tp_partitioned[name] = _tp_partitioned(module, ctx)
    out._unit_tp[name] = ctx.tp_size
    out.contexts[name] = ctx
    unit = wrap(
        name,
        module,
        dp_type,
        out.groups.get(shard) if len(shard) > 1 else None,
        out.precision,
        out.options.reduce_every_micro_batch,
    )
    out.units.append(unit)
    return unit.module


def _tp_partitioned(module: nn.Module, ctx: ParallelContext) -> set[str]:
    """Names of the parameters split over the tp group (each tp rank holds a different shard).

    The parallel blocks tag every split parameter with megatron's ``tensor_model_parallel`` attribute
    (:func:`galva_hp.parallel.tensor_parallel.mark_tp_split`); everything else in a tp module is a replica (norms,
    row-parallel biases, replicated K/V under GQA).
    """
    return {n for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)}


def _redistribution(plan: RedistributionPlan, cache: ProcessGroupCache, rank: int) -> nn.Module:
    return Redistribute(plan, rank, cache)


def _separate_tied_copies(model: LayeredModel) -> None:
    """Give the head its own copy of every tied weight that it shares with the embedding as one tensor object.

    Hugging Face ties weights by sharing one ``Parameter``; a parallelizer that keeps a degree-1 module as it is
    would then hand the same tensor to the embedding's and the head's data-parallel units: its gradient would be
    reduced by both and doubled by the tie, and the optimizer would update it twice. With two copies, the runtime's
    one tie mechanism applies everywhere: gradients summed once, values kept equal (:meth:`sync_tied_weights`).
    """
    for emb_name, head_name in model.tied_weights:
        emb = model.embedding.get_parameter(emb_name.removeprefix("embedding."))
        head_path = head_name.removeprefix("head.")
        if model.head.get_parameter(head_path) is not emb:
            continue
        owner_path, _, attr = head_path.rpartition(".")
        owner = model.head.get_submodule(owner_path) if owner_path else model.head
        setattr(owner, attr, nn.Parameter(emb.detach().clone(), requires_grad=emb.requires_grad))


def _tie(out: HybridParallelModel, tied: Sequence[tuple[str, str]]) -> None:
    if not tied:
        return
    masters = {
        f"{unit.name}.{n}": p
        for unit in out.units
        if unit.name in ("embedding", "head")
        for n, p in unit.master_parameters()
    }
    tie_group = next((g for g in out.layout.embedding_ties if out.rank in g), None)
    for emb_name, head_name in tied:
        emb = masters.get(emb_name) if out.is_first else None
        head = masters.get(head_name) if out.is_last else None
        for side, name, param in (("embedding", emb_name, emb), ("head", head_name, head)):
            if param is None and (out.is_first if side == "embedding" else out.is_last):
                raise ValueError(f"tied weight {name}: no such parameter in the parallel {side} (names must be kept)")
        if out.strategy.pp == 1:
            out._ties.append((emb, head, None, out.rank))
        elif emb is not None or head is not None:
            assert tie_group is not None
            out._ties.append((emb, head, out.groups.get(tie_group), tie_group[0]))
