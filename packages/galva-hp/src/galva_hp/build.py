"""Build this rank's part of a :class:`~galva_hp.model.LayeredModel` under a :class:`~galva_schema.Strategy`.

:func:`build` does, in order:

1. validate the plan against the model, the world and the sequence length (before any process group exists);
2. create every process group of the plan through a :class:`~galva_comm.groups.ProcessGroupCache`, in
   :meth:`~galva_comm.layout.RankLayout.all_groups` order (one communicator per distinct rank tuple);
3. keep only this rank's pipeline stage; materialise meta modules one at a time (deferred init);
4. convert each module with the model's parallelizer and a :class:`~galva_hp.model.ParallelContext` of its layer;
5. wrap activation checkpointing, then data parallelism (ddp / zero2 / zero3 over the layer's sharding group);
6. insert a redistribution wherever a layer's input layout differs from its predecessor's output layout;
7. parameters read by several modules (the embedding-to-head tie, shared tables) are taken out of their readers'
   forms or lent between them, one copy per rank of their readers' stages (:mod:`galva_hp.shared_params`).

The result is a :class:`~galva_hp.runtime.HybridParallelModel` in training mode (dropout on), whatever mode the
modules came in. Plan validation lives in :mod:`galva_hp.plan_check`
and the options in :mod:`galva_hp.options`; both are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch.distributed as dist
from torch import nn

from galva_comm.groups import ProcessGroupCache
from galva_comm.layout import LayerGroups, RankLayout
from galva_comm.shards import RedistributionPlan
from galva_hp.activation_checkpoint import Checkpointed
from galva_hp.data_parallel import DdpUnit, wrap
from galva_hp.deferred_init import is_meta, materialize
from galva_hp.grad_buckets import BucketReducer
from galva_hp.model import LayeredModel, ParallelContext, Parallelizer
from galva_hp.options import BuildOptions
from galva_hp.parallel.balance import BalanceLedger
from galva_hp.parallel.redistribute import Redistribute
from galva_hp.plan_check import check_plan
from galva_hp.precision import PrecisionPolicy
from galva_hp.runtime import HybridParallelModel
from galva_hp.shared_params import SharedParameters
from galva_schema import DataParallelType, GroupKind, Strategy
from galva_schema.vocabulary import EMBEDDING_MODULE, HEAD_MODULE, layer_module

__all__ = ["BuildOptions", "HybridParallelModel", "build", "check_plan"]


def build(model: LayeredModel, strategy: Strategy, options: BuildOptions | None = None) -> HybridParallelModel:
    """Build this rank's part of ``model`` under ``strategy`` (collective: every rank of the world calls it)."""
    options = options or BuildOptions()
    if not dist.is_initialized():
        raise RuntimeError("build() needs torch.distributed to be initialised (torchrun, or run_distributed in tests)")
    rank, world = dist.get_rank(), dist.get_world_size()
    check_plan(model, strategy, world, options.seq_len)
    precision = PrecisionPolicy.from_precision(strategy.mixed_precision, options.reduce_in_fp32)

    layout = RankLayout(strategy)
    groups = ProcessGroupCache()
    groups.create_for_layout(layout)  # includes the groups of every boundary's forward and backward exchange
    SharedParameters.create_groups(model.shared, strategy, layout, groups)

    out = HybridParallelModel(strategy, layout, groups, rank, options, precision)
    out.ledger = _ledger(model, out, layout, groups)
    compute_dtype = precision.param_dtype if precision.low_precision else None
    out.shared = SharedParameters.for_stage(model.shared, strategy, layout, groups, rank, compute_dtype, options.device)
    parallelizer = model.parallelizer
    if out.is_first:
        ctx = _context(layout.vocab_first, rank, groups, strategy.megatron_sp, strategy.vocab.sp)
        module = _convert(EMBEDDING_MODULE, model.embedding, options, lambda m: parallelizer.embedding(m, ctx))
        out.shared.release(EMBEDDING_MODULE, module)
        out.embedding = _wrap(out, EMBEDDING_MODULE, module, layout.vocab_first, ctx, False)
    for index in out.layer_indices():
        name, layer_type = layer_module(index), model.layer_types[index]
        ctx = _context(layout.layers[index], rank, groups, strategy.megatron_sp, False, out.ledger)
        convert = partial(_convert_layer, parallelizer, layer_type, ctx, out.shared, name)
        module = _convert(name, model.layers[index], options, convert)
        out.shared.release(name, module)  # read through its SharedWeight or lent: outside this data-parallel unit
        checkpoint = strategy.layers[index].checkpoint
        out.layers[str(index)] = _wrap(out, name, module, layout.layers[index], ctx, checkpoint, index)
    if out.is_last:
        ctx = _context(layout.vocab_last, rank, groups, strategy.megatron_sp, strategy.vocab.sp)
        module = _convert(HEAD_MODULE, model.head, options, lambda m: parallelizer.head(m, ctx))
        out.shared.release(HEAD_MODULE, module)
        out.head = _wrap(out, HEAD_MODULE, module, layout.vocab_last, ctx, False)
    for index, plan in layout.boundary_plans():
        if rank in plan.target.ranks:
            out.redistributions[str(index)] = _redistribution(plan, groups, rank)
    chunk_of = {id(u): c for c in strategy.stage_chunks(out.stage) for u in out.chunk_units(c)}
    out.reducer = BucketReducer([u for u in out.units if isinstance(u, DdpUnit)], chunk_of, options.bucket_cap_bytes)
    out.sync_shared_weights()
    # a model for training, whatever the modules' source: transformers' from_pretrained hands its modules over in
    # eval mode, which would switch every dropout off silently
    return out.train()


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


def _convert_layer(
    parallelizer: Parallelizer,
    layer_type: str,
    ctx: ParallelContext,
    shared: SharedParameters,
    name: str,
    module: nn.Module,
) -> nn.Module:
    shared.capture(name, module)  # materialised: the home of a shared parameter gives its first value
    return parallelizer.layer(module, layer_type=layer_type, ctx=ctx)


def _context(
    groups: LayerGroups,
    rank: int,
    cache: ProcessGroupCache,
    megatron_sp: bool,
    vocab_sp: bool,
    ledger: BalanceLedger | None = None,
) -> ParallelContext:
    tp, sp, cp = groups.of(GroupKind.TP, rank), groups.of(GroupKind.SP, rank), groups.of(GroupKind.CP, rank)
    ep, etp = groups.of(GroupKind.EP, rank), groups.of(GroupKind.ETP, rank)
    return ParallelContext(
        tp_group=cache.get(tp) if len(tp) > 1 else None,
        sp_group=cache.get(sp) if len(sp) > 1 else None,
        megatron_sp=megatron_sp,
        vocab_sp=vocab_sp,
        cp_group=cache.get(cp) if len(cp) > 1 else None,
        cp_index=groups.activation.cp_index(rank),
        ep_group=cache.get(ep) if len(ep) > 1 else None,
        etp_group=cache.get(etp) if len(etp) > 1 else None,
        ledger=ledger,
    )


def _ledger(
    model: LayeredModel, out: HybridParallelModel, layout: RankLayout, cache: ProcessGroupCache
) -> BalanceLedger | None:
    """The router statistics of a model whose loss takes them over every layer (None for any other model)."""
    if model.router_loss is None:
        return None
    experts, coef = model.router_loss
    whole = next(g for g in [*layout.layers, layout.vocab_first] if g.stage == out.stage).of(GroupKind.WHOLE, out.rank)
    pipe = out.pipe
    return BalanceLedger(
        experts,
        coef,
        out.strategy.num_micro_batches,
        cache.get(whole) if len(whole) > 1 else None,
        (pipe.ranks, pipe.group) if pipe.group is not None else None,
        out.options.device,
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
    if dp_type is DataParallelType.ZERO3 and out.shared.lends(name):
        # another module of this rank reads a parameter of this one (a tied head): it stays gathered between the
        # two forwards and their backwards, the states sharded as under ZeRO-3
        dp_type = DataParallelType.ZERO2
    shard = groups.of(GroupKind.SHARD, out.rank)
    out._tp_partitioned[name] = _tp_partitioned(module, ctx)
    out._unit_tp[name] = ctx.tp_size
    out.contexts[name] = ctx
    share = groups.activation
    if share.dp * share.cp > 1:  # ranks holding different samples or chunks: each masks its own (parallel.rng)
        out.replica_index[name] = share.coords(out.rank)[1] * share.cp + share.cp_index(out.rank)
    experts = _expert_modules(module)
    # named before their unit wraps them (FSDP2 replaces the parameters, and the mark with them)
    expert_names = frozenset(n for n, p in module.named_parameters() if getattr(p, "galva_expert", False))
    if experts:  # before the layer's own unit: FSDP2 nests inner units first
        assert index is not None
        edp = groups.of(GroupKind.EDP, out.rank)
        for path in experts:
            expert_name = f"{name}.{path}"
            sub = module.get_submodule(path)
            out._tp_partitioned[expert_name] = {n for n, _ in sub.named_parameters()}
            out._unit_tp[expert_name] = ctx.tp_size
            out.units.append(
                wrap(
                    expert_name,
                    sub,
                    strategy.layer_expert_dp_type(index),
                    out.groups.get(edp) if len(edp) > 1 else None,
                    out.precision,
                    out.options.reduce_every_micro_batch,
                )
            )
    unit = wrap(
        name,
        module,
        dp_type,
        out.groups.get(shard) if len(shard) > 1 else None,
        out.precision,
        out.options.reduce_every_micro_batch,
        expert_names,
    )
    out.units.append(unit)
    out.shared.hold(name, unit)
    return unit.module


def _expert_modules(module: nn.Module) -> list[str]:
    """Paths of the submodules whose parameters are all experts (the parallel form marked them ``galva_expert``)."""
    owners = {n.rpartition(".")[0] for n, p in module.named_parameters() if getattr(p, "galva_expert", False)}
    return sorted(owners)


def _tp_partitioned(module: nn.Module, ctx: ParallelContext) -> set[str]:
    """Names of the parameters split over the tp group (each tp rank holds a different shard).

    The parallel blocks tag every split parameter with megatron's ``tensor_model_parallel`` attribute
    (:func:`galva_hp.parallel.tensor_parallel.mark_tp_split`); everything else in a tp module is a replica (norms,
    row-parallel biases, replicated K/V under GQA).
    """
    return {n for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)}


def _redistribution(plan: RedistributionPlan, cache: ProcessGroupCache, rank: int) -> nn.Module:
    return Redistribute(plan, rank, cache)
