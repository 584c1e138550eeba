"""Costs of the transformer layers: time and memory of one layer under each candidate plan, for one micro-batch
size (docs/cost-model.md §3, §4), and what re-sharding between two neighbouring layers costs (§5).

Everything is computed for a *list* of candidates at once (numpy arrays indexed by candidate), so that a search
builds one table per (layer type, pipeline degree, micro-batch size) and never loops over plans in Python inside
the dynamic programme.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cache

import numpy as np

from galva_comm.layout import ranks_per_stage, sharding_group_shape
from galva_schema import (
    BatchTime,
    DataParallelType,
    HardwareProfile,
    LayerTypeProfile,
    ModelProfile,
    ParallelForm,
    SchemaError,
    SequenceTime,
    StaticTime,
)
from galva_schema.constraints import head_problem
from galva_schema.model_profile import OverheadForm, ShardedForm
from galva_schema.sharding import sequence_shards
from galva_search import expert_costs
from galva_search.collectives import MIB, Collectives
from galva_search.compute_speed import compute_scale
from galva_search.cost_settings import CostSettings
from galva_search.ring_costs import ring_bandwidth_gb_per_s, ring_terms
from galva_search.space import Candidate
from galva_search.states import state_fraction
from galva_search.transitions import redistribution_calls, redistribution_per_sample, switch_penalty

_state_fraction = cache(state_fraction)  # a table asks it per candidate of the few (type, shard, ...) there are

ZERO2 = DataParallelType.ZERO2
ZERO3 = DataParallelType.ZERO3

@dataclass(frozen=True)
class LayerTerms:
    """Per-candidate costs of ONE layer of one type for one micro-batch size (arrays indexed by candidate).

    Times are seconds per micro-batch unless said otherwise; memory is MiB per device.
    """

    forward_s: np.ndarray  # forward compute
    backward_s: np.ndarray  # backward compute, recomputation included
    tp_comm_s: np.ndarray  # Megatron tp / Megatron-SP / Ulysses collectives (forward + backward + recompute)
    zero3_comm_s: np.ndarray  # ZeRO-3 all-gathers and reduce-scatter, wall time added to the micro-batch
    micro_batch_s: np.ndarray  # critical-path time of the layer in one micro-batch (sum of the above, overlapped)
    grad_sync_s: np.ndarray  # once per iteration: gradient all-reduce (ddp) / reduce-scatter + all-gather (zero2)
    exposed_sync_s: np.ndarray  # part of grad_sync_s not hidden behind the last micro-batch's backward
    p2p_s: np.ndarray  # one point-to-point transfer of this layer's output activation to the next stage
    states_mib: np.ndarray  # parameters + gradients + optimizer states
    activation_mib: np.ndarray  # activations kept for ONE in-flight micro-batch
    transient_mib: np.ndarray  # held only while this layer runs (ZeRO-3 gather, recomputation, Megatron-SP gather)
    # weight-gradient (W) share of backward_s, the work zb-h1 defers into the bubble, without recomputation: the
    # model profile's measured weight_grad_share, else half (a matmul's input and weight gradients cost the same
    # FLOPs; docs §7)
    weight_grad_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # expert dispatch / combine (and etp gathers): the part of tp_comm_s that is the experts' all-to-alls
    expert_comm_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ring_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # context parallelism: ring transfers exposed
    # once per iteration, part of the optimizer step: the rank's share of the layer (the profile's measured
    # optimizer_step_ms; without it the hardware's rate prices the states) and AdamW on a ZeRO layer's sharded
    # (DTensor) parameters beyond plain tensors of the same shards (the profile's sharded_overhead_ms)
    step_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # a ddp layer's gradient all-reduce as galva-hp buckets it (galva_search.sync_buckets): bytes per rank and group
    # (size, consecutive); bucket_bytes 0 where nothing joins a bucket (ZeRO, one rank, routed experts)
    bucket_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    bucket_group: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    # a ZeRO-2 layer's parameter all-gather, which galva-hp repeats before every micro-batch's forward (sync_s counts
    # one a iteration): the score and the stage DP add (c - 1) of them, where the micro-batch count is known
    regather_s: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def memory_mib(self, in_flight: float) -> np.ndarray:
        return self.states_mib + in_flight * self.activation_mib


@dataclass(frozen=True)
class _LayerStatic:
    tp: np.ndarray
    dp: np.ndarray
    cp: np.ndarray
    ring_gb_per_s: np.ndarray  # context parallelism: bandwidth between ring neighbours
    checkpoint: np.ndarray
    zero3: np.ndarray
    sync: np.ndarray
    gather: np.ndarray  # ZeRO-2/3: one all-gather of the layer's parameters (part of sync); 0 for ddp
    p2p_per_byte: np.ndarray
    comm_groups: list
    states: np.ndarray  # [not accumulating, accumulating][candidate]
    activation_per_sample: np.ndarray
    recompute_per_sample: np.ndarray  # checkpointed candidates: what the recomputation holds during backward
    gather_mib: np.ndarray  # ZeRO-3: one full compute-precision copy of the layer's parameters on this rank
    redistribution_per_sample: np.ndarray
    redistribution_calls: np.ndarray  # [from][to]: seconds per micro-batch of the boundary's calls themselves
    penalty: np.ndarray
    overhead_ms: np.ndarray  # [candidate][forward, backward]: the parallel form's own cost per call
    # [candidate][forward, backward, step, accumulating backward]: a ZeRO unit's own cost (FSDP2, DTensor step)
    sharded_ms: np.ndarray
    step_ms: np.ndarray  # [candidate]: the optimizer step of the rank's share of the layer (measured; else 0)
    bucket_bytes: np.ndarray  # [candidate]: ddp gradient bytes a bucket takes (0: not bucketed)
    bucket_group: np.ndarray  # [candidate][group size, consecutive] of that all-reduce

    def rows(self, index: np.ndarray, comm_groups: list) -> _LayerStatic:
        """These costs for the candidates ``index`` (in that order), whose own collective groups are ``comm_groups``:
        every other value is one candidate's (or one pair's), so taking rows gives what computing them would."""
        pairs = np.ix_(index, index)
        return _LayerStatic(
            tp=self.tp[index], dp=self.dp[index], cp=self.cp[index], ring_gb_per_s=self.ring_gb_per_s[index],
            checkpoint=self.checkpoint[index], zero3=self.zero3[index], sync=self.sync[index],
            gather=self.gather[index], p2p_per_byte=self.p2p_per_byte[index], comm_groups=comm_groups,
            states=self.states[:, index], activation_per_sample=self.activation_per_sample[index],
            recompute_per_sample=self.recompute_per_sample[index], gather_mib=self.gather_mib[index],
            redistribution_per_sample=self.redistribution_per_sample[pairs],
            redistribution_calls=self.redistribution_calls[pairs], penalty=self.penalty[pairs],
            overhead_ms=self.overhead_ms[index], sharded_ms=self.sharded_ms[index], step_ms=self.step_ms[index],
            bucket_bytes=self.bucket_bytes[index], bucket_group=self.bucket_group[index],
        )  # fmt: skip


class LayerCosts:
    """Per-candidate costs of the layers of one model profile on one hardware profile (cached per candidate list)."""

    def __init__(
        self,
        hardware: HardwareProfile,
        model: ModelProfile,
        settings: CostSettings,
        comm: Collectives,
        model_source: str | None = None,
    ) -> None:
        self.hardware = hardware
        self.model = model
        self.settings = settings
        self.comm = comm
        self.model_source = model_source
        self.world_size = hardware.cluster.world_size
        self._compute_scale = compute_scale(hardware, model)
        self._static_cache: dict[tuple[int, tuple[Candidate, ...]], _LayerStatic] = {}

    def activation_per_sample(self, type_index: int, candidates: Sequence[Candidate]) -> np.ndarray:
        """Activation MiB per local sample kept for backward by each candidate (before in-flight multiplication);
        context parallelism keeps ``1 / cp`` of the tokens, so ``1 / cp`` of each."""
        layer = self.model.layer_types[type_index]
        table = layer.activation_mib_per_sample
        out = np.empty(len(candidates))
        for i, c in enumerate(candidates):
            if c.checkpoint:
                # only the layer input is kept; Megatron-SP and Ulysses shard it along the sequence
                shards = sequence_shards(c.tp, ulysses=c.ulysses, megatron_sp=self.settings.megatron_sp)
                out[i] = layer.checkpoint_activation_mib_per_sample / shards
            elif c.ulysses:
                # measured under Ulysses (all-to-all buffers included) where profiled; else every activation of
                # the plain layer split along the sequence
                ulysses = layer.ulysses_activation_mib_per_sample
                out[i] = ulysses[c.tp] if c.tp in ulysses else table[1] / c.tp
            elif c.tp > 1 and self.settings.megatron_sp and c.tp in layer.megatron_sp_activation_mib_per_sample:
                out[i] = layer.megatron_sp_activation_mib_per_sample[c.tp]
            else:
                if c.tp not in table and not self._runs_tp(type_index, c.tp):
                    out[i] = np.inf  # the model refuses this tp (ModelRules masks it): nobody profiles it
                elif c.tp not in table:
                    raise SchemaError(
                        f"layer_types[{type_index}].activation_mib_per_sample: no entry for tp {c.tp} "
                        f"(layer type {layer.name!r}); profile it or lower --max-tp",
                        source=self.model_source,
                    )
                else:
                    out[i] = table[c.tp]
            out[i] += expert_costs.extra_activation_per_sample(layer, c)
            if c.cp > 1 and not c.checkpoint:
                # galva-hp's ring keeps its attention output and the output projection its own copy: one more
                # [S, H / tp] tensor than the profiled attention (measured by galva-profile check)
                out[i] += layer.seq_length * layer.hidden_size * self.settings.element_bytes / c.tp / MIB
        return out / np.array([c.cp for c in candidates], dtype=float)

    def _runs_tp(self, type_index: int, tp: int) -> bool:
        """Whether the model's constraints (if the profile has them) let this layer type run Megatron tp ``tp``."""
        constraints = self.model.constraints
        if constraints is None:
            return True
        own = constraints.layer_types[type_index]
        return ParallelForm.TP not in own.unsupported and head_problem(own, tp, ulysses=False) is None

    def _static(self, type_index: int, candidates: tuple[Candidate, ...]) -> _LayerStatic:
        """Parts of the layer costs that do not depend on the micro-batch size (cached per candidate list).

        A search asks for many lists of one pipeline degree (those whose dp divides each micro-batch); every value
        here is a candidate's own (or a pair's), so a list inside one already priced takes its rows from it."""
        key = (type_index, candidates)
        hit = self._static_cache.get(key)
        if hit is None:
            hit = self._static_cache[key] = self._rows_of_wider(type_index, candidates) or self._compute_static(
                type_index, candidates
            )
        return hit

    def _rows_of_wider(self, type_index: int, candidates: tuple[Candidate, ...]) -> _LayerStatic | None:
        """The static costs of ``candidates`` taken from a cached list that holds all of them (None: no such list)."""
        wanted = set(candidates)
        for (t, wider), static in self._static_cache.items():
            if t == type_index and len(wider) > len(candidates) and wanted.issubset(wider):
                position = {c: i for i, c in enumerate(wider)}
                index = np.array([position[c] for c in candidates], dtype=int)
                layer = self.model.layer_types[type_index]
                return static.rows(index, _comm_groups(layer, candidates, self.settings.megatron_sp))
        return None

    def _compute_static(self, type_index: int, candidates: tuple[Candidate, ...]) -> _LayerStatic:
        layer = self.model.layer_types[type_index]
        s = self.settings
        comm = self.comm
        n = len(candidates)
        e = s.element_bytes
        split = np.array([expert_costs.parameter_split(layer, c) for c in candidates], dtype=float).reshape(n, 2)
        params_mib, expert_mib = split[:, 0], split[:, 1]  # per rank, fp32 bytes: the rest, the routed experts
        # gradients are reduced in the dtype the runtime keeps them in (galva-hp: fp32, also under bf16), ZeRO
        # gathers move the compute copy (its element size)
        elements, expert_elements = params_mib * MIB / 4.0, expert_mib * MIB / 4.0
        grad_bytes, expert_grad_bytes = elements * s.state_bytes[1], expert_elements * s.state_bytes[1]
        param_bytes, expert_param_bytes = elements * e, expert_elements * e
        sync = np.zeros(n)
        gather = np.zeros(n)
        p2p_per_byte = np.zeros(n)
        step_ms = np.zeros(n)
        bucket_bytes, bucket_group = np.zeros(n), np.zeros((n, 2))
        pp = candidates[0].pp if candidates else 1
        stage_size = ranks_per_stage(self.world_size, pp)
        for i, c in enumerate(candidates):
            d, consecutive = sharding_group_shape(stage_size, c.tp, c.consecutive, c.ulysses)
            if d > 1:
                if c.dp_type in (ZERO2, ZERO3):  # reduce-scatter + all-gather, each with its own measured latency
                    gather[i] = comm.all_gather(d, consecutive, param_bytes[i])
                    sync[i] = comm.reduce_scatter(d, consecutive, grad_bytes[i]) + gather[i]
                else:
                    sync[i] = comm.allreduce(d, consecutive, grad_bytes[i])
                    if layer.experts is None:
                        bucket_bytes[i], bucket_group[i] = grad_bytes[i], (d, consecutive)
            edp = c.expert_dp if layer.experts is not None else 1
            if edp > 1:  # the experts' own gradient sync over their replicas (strided by ep * etp)
                strided = c.ep * c.etp == 1
                if expert_costs.expert_dp_type(c) in (ZERO2, ZERO3):
                    expert_gather = comm.all_gather(edp, strided, expert_param_bytes[i])
                    if expert_costs.expert_dp_type(c) is ZERO3:
                        gather[i] += expert_gather
                    sync[i] += comm.reduce_scatter(edp, strided, expert_grad_bytes[i]) + expert_gather
                else:
                    sync[i] += comm.allreduce(edp, strided, expert_grad_bytes[i])
            if pp > 1:
                shards = sequence_shards(c.tp, ulysses=c.ulysses, megatron_sp=s.megatron_sp) * c.cp
                p2p_per_byte[i] = comm.p2p(pp, 1.0) / shards
            if layer.optimizer_step_ms is not None:  # the layer's tensors (a fixed cost), the elements this rank steps
                fixed, per_million = layer.optimizer_step_ms
                own = elements[i] / (d if c.dp_type in (ZERO2, ZERO3) else 1)
                zero_experts = expert_costs.expert_dp_type(c) in (ZERO2, ZERO3)
                own += expert_elements[i] / (edp if zero_experts else 1)
                step_ms[i] = fixed + per_million * own / 1e6
        zero3 = np.array([c.dp_type is ZERO3 for c in candidates])
        expert_zero3 = np.array([expert_costs.expert_dp_type(c) is ZERO3 for c in candidates]) & (expert_mib > 0)
        total_state_bytes = sum(s.state_bytes)
        recompute = np.zeros(n)
        if any(c.checkpoint for c in candidates):
            plain = [replace(c, checkpoint=False) if c.checkpoint else c for c in candidates]
            full = self.activation_per_sample(type_index, plain)
            recompute = np.where([c.checkpoint for c in candidates], full, 0.0)
        states = np.empty((2, n))
        for accumulating in (0, 1):
            for i, c in enumerate(candidates):
                shard = sharding_group_shape(stage_size, c.tp, c.consecutive, c.ulysses)[0]
                frac = _state_fraction(
                    c.dp_type, shard, bool(accumulating), precision=s.precision, accounting=s.state_accounting
                )
                states[accumulating, i] = params_mib[i] / 4.0 * total_state_bytes * frac
                if expert_mib[i] > 0:
                    frac = _state_fraction(
                        expert_costs.expert_dp_type(c), c.expert_dp, bool(accumulating), precision=s.precision,
                        accounting=s.state_accounting,
                    )
                    states[accumulating, i] += expert_mib[i] / 4.0 * total_state_bytes * frac
        static = _LayerStatic(
            tp=np.array([c.tp for c in candidates], dtype=float),
            dp=np.array([c.dp for c in candidates], dtype=float),
            cp=np.array([c.cp for c in candidates], dtype=float),
            # a ring spans cp model-parallel groups (cp ranks when they are strided): priced at the pipeline whose
            # neighbours are half that span apart, its slowest link inside a node only when the whole span is
            ring_gb_per_s=np.array(
                [
                    ring_bandwidth_gb_per_s(comm, (c.tp if c.consecutive else 1) * c.cp // 2) if c.cp > 1 else 1.0
                    for c in candidates
                ]
            ),
            checkpoint=np.array([c.checkpoint for c in candidates]),
            zero3=zero3 | expert_zero3,
            sync=sync,
            gather=gather,
            p2p_per_byte=p2p_per_byte,
            comm_groups=_comm_groups(layer, candidates, s.megatron_sp),
            states=states,
            activation_per_sample=self.activation_per_sample(type_index, candidates),
            recompute_per_sample=recompute,
            gather_mib=(np.where(zero3, params_mib, 0.0) + np.where(expert_zero3, expert_mib, 0.0)) / 4.0 * e,
            redistribution_per_sample=redistribution_per_sample(
                comm, candidates, stage_size, s.megatron_sp, layer.seq_length * layer.hidden_size * e
            ),
            redistribution_calls=redistribution_calls(comm, candidates, stage_size, s.megatron_sp),
            penalty=switch_penalty(candidates, s.switch_penalty_s),
            overhead_ms=np.array([_overhead_ms(layer, c, s.megatron_sp) for c in candidates], dtype=float).reshape(
                n, 2
            ),
            sharded_ms=np.array(
                [_sharded_ms(layer, c, sharding_group_shape(stage_size, c.tp, c.consecutive, c.ulysses)[0])
                 for c in candidates],
                dtype=float,
            ).reshape(n, 4),
            step_ms=step_ms,
            bucket_bytes=bucket_bytes,
            bucket_group=bucket_group,
        )
        return static

    def terms(
        self, type_index: int, candidates: Sequence[Candidate], micro_batch: int, num_micro_batches: int
    ) -> LayerTerms:
        """Costs of one layer of type ``type_index`` under each candidate, for a global micro-batch of
        ``micro_batch`` samples and ``num_micro_batches`` micro-batches per iteration."""
        candidates = tuple(candidates)
        st = self._static(type_index, candidates)
        layer = self.model.layer_types[type_index]
        s = self.settings
        comm = self.comm
        f = s.factors
        local = micro_batch / st.dp  # samples per rank
        # context parallelism: 1 / cp of the tokens and, the chunks balanced, of the attention pairs
        compute_factor = f.compute * self._compute_scale
        forward = _layer_forward_seconds(layer, local / (st.tp * st.cp)) + expert_costs.extra_forward_seconds(
            layer, candidates, local / st.cp
        )
        forward = np.maximum(0.0, forward) * compute_factor
        # the layer's backward: measured beside its forward where profiled (the experts' extra at the coefficient),
        # else the coefficient's multiple of the forward
        weight_grad = (
            (
                np.maximum(0.0, forward_seconds(layer.backward_time, local / (st.tp * st.cp), layer.seq_length))
                + s.backward_coefficient * expert_costs.extra_forward_seconds(layer, candidates, local / st.cp)
            )
            * compute_factor
            if layer.backward_time is not None
            else s.backward_coefficient * forward
        )
        # a parallel form's own cost per call beyond the plain layer's F(b/tp) (the profile's measured overhead)
        extra_forward, extra_backward = (st.overhead_ms * 1e-3 * compute_factor).T
        # a ZeRO unit's own work per call (FSDP2's hooks and copies around its collectives), not recomputed: its
        # hooks are on the unit, outside the checkpointed module. With several micro-batches every backward but the
        # last accumulates (gradient sync off): the micro-batch pays that one, the last its reducing one's surplus
        sharded_forward, reducing, accumulating = (st.sharded_ms[:, [0, 1, 3]] * 1e-3 * compute_factor).T
        sharded_backward = accumulating if num_micro_batches > 1 else reducing
        last_backward = reducing - sharded_backward
        # weight_grad is the matmuls' share: the overhead below is not deferrable work
        forward = forward + extra_forward
        recompute = np.where(st.checkpoint, forward, 0.0)
        forward = forward + sharded_forward
        backward = weight_grad + extra_backward + sharded_backward + recompute
        act_bytes = local * layer.seq_length * layer.hidden_size * s.element_bytes / st.cp
        tp_comm = np.zeros(len(candidates))
        expert_comm = np.zeros(len(candidates))
        for op, size, consecutive, index, scale, count, expert, busy in st.comm_groups:
            per = getattr(comm, op)(size, consecutive, act_bytes[index] * scale, busy=busy) * count * f.tp_comm
            np.add.at(tp_comm, index, per)  # a candidate may appear twice in a group (expert dispatch's two sizes)
            if expert:
                np.add.at(expert_comm, index, per)
        sync = st.sync * f.dp_comm
        # ZeRO-3, every micro-batch: all-gather before forward (exposed), all-gather overlapped with backward.
        # Its reduce-scatter runs in the last micro-batch only (FSDP2 without gradient sync before it): once per
        # iteration, overlapped with that backward together with the all-gather (docs/cost-model.md §3).
        gather = st.gather * f.dp_comm
        gather_bwd = comm.overlapped(backward, gather)
        zero3_wall = np.where(st.zero3, gather + gather_bwd - backward, 0.0)
        ring, kv_buffer = ring_terms(
            layer, candidates, local, comm, st.ring_gb_per_s, s.element_bytes, s.backward_coefficient, compute_factor
        )
        ring = ring * f.tp_comm
        micro = forward + backward + tp_comm + zero3_wall + ring
        # the last micro-batch's backward (its surplus included) hides the sync
        synced = comm.overlapped(backward + last_backward, sync)
        exposed = np.where(st.zero3, synced - gather_bwd, synced - backward)
        per_call = np.where(st.checkpoint, 0.0, layer.activation_mib_per_call / st.cp)  # per-position tables, cut
        expert_rows = expert_costs.imbalance_activation(layer, candidates, local)  # the busiest rank's extra rows
        act = (local * st.activation_per_sample + per_call + expert_rows) * f.activations
        transient = (local * st.recompute_per_sample + kv_buffer) * f.activations + 2.0 * st.gather_mib * f.states
        share = 0.5 if layer.weight_grad_share is None else layer.weight_grad_share  # the profile's measured W share
        return LayerTerms(
            forward_s=forward,
            backward_s=backward,
            tp_comm_s=tp_comm,
            zero3_comm_s=zero3_wall,
            micro_batch_s=micro,
            grad_sync_s=sync,
            exposed_sync_s=exposed,
            p2p_s=(st.p2p_per_byte * act_bytes + comm.p2p_latency(candidates[0].pp if candidates else 1)) * f.p2p,
            states_mib=st.states[1 if num_micro_batches > 1 else 0] * f.states,
            activation_mib=act,
            transient_mib=transient,
            weight_grad_s=share * weight_grad,
            expert_comm_s=expert_comm,
            ring_s=ring,
            step_s=(st.sharded_ms[:, 2] + st.step_ms) * 1e-3 * compute_factor,
            bucket_bytes=st.bucket_bytes,
            bucket_group=st.bucket_group,
            regather_s=np.where(st.zero3, 0.0, gather),
        )

    def redistribution(self, type_index: int, candidates: Sequence[Candidate], micro_batch: int) -> np.ndarray:
        """``[S][S]`` seconds per micro-batch to move activations (forward) and their gradients (backward) from a
        layer under candidate ``i`` to the next layer, of type ``type_index``, under candidate ``j``
        (:mod:`galva_search.transitions`: what galva_comm's redistribution plans move, and their calls)."""
        factor = self.settings.factors.redistribution
        static = self._static(type_index, tuple(candidates))
        return (static.redistribution_per_sample * micro_batch + static.redistribution_calls) * factor

    def switch_penalties(self, type_index: int, candidates: Sequence[Candidate]) -> np.ndarray:
        """``[S][S]`` tie-breaker seconds between neighbours (:func:`galva_search.transitions.switch_penalty`)."""
        return self._static(type_index, tuple(candidates)).penalty


def _comm_groups(layer: LayerTypeProfile, candidates: Sequence[Candidate], megatron_sp: bool) -> list:
    """The layer's collectives per micro-batch, grouped by (collective, group size, consecutive, expert, busy): the
    candidates of each group, their buffer scale (times the ``[local, seq, hidden]`` activation bytes) and calls.
    ``busy``: the call follows a stretch of compute and pays the profile's busy extra; a call right after another
    over the same group (a norm between) finds its ranks arriving together and costs its idle curve."""
    # key's last two: expert dispatch, busy
    groups: dict[tuple[str, int, bool, bool, bool], list[tuple[int, float, float]]] = {}
    for i, c in enumerate(candidates):
        # recomputation stops once every tensor the backward saved is back (torch's non-reentrant checkpoint): the
        # layer's last collective, whose output only the next layer reads, is not repeated (galva-hp, counted)
        if c.tp > 1 and not c.ulysses and megatron_sp:
            # 2 all-gather + reduce-scatter pairs forward, 2 backward; recomputing, 2 all-gathers and 1
            # reduce-scatter more; each priced by its own measured curve (latency included), without the curves a
            # pair is one all-reduce, as below. Every reduce-scatter follows a region's matmuls; every all-gather
            # follows a reduce-scatter with a norm between (forward: the last region's exit, then the next one's
            # entry; backward: the entry's gradient, then the exit's), except, recomputing, the backward's first,
            # after the recomputed MLP. On 4 gloo ranks sharing 2 cores the all-gathers took 1.8 ms a call inside a
            # step, near their idle 1.3, against 2.4 busy (a layer's boundaries with the embedding, the head and a
            # stage's p2p are left as the rest)
            groups.setdefault(("all_gather", c.tp, c.consecutive, False, False), []).append(
                (i, 1.0, 5.0 if c.checkpoint else 4.0)
            )
            if c.checkpoint:
                groups.setdefault(("all_gather", c.tp, c.consecutive, False, True), []).append((i, 1.0, 1.0))
            scatters = 5.0 if c.checkpoint else 4.0
            groups.setdefault(("reduce_scatter", c.tp, c.consecutive, False, True), []).append((i, 1.0, scatters))
        elif c.tp > 1 and not c.ulysses:
            # 2 all-reduces forward, 2 backward, 1 more when recomputing
            count = 5.0 if c.checkpoint else 4.0
            groups.setdefault(("allreduce", c.tp, c.consecutive, False, True), []).append((i, 1.0, count))
        elif c.ulysses:
            # 2 all-to-alls forward (q, k and v in one message, then the output), 2 backward, 2 more when recomputing
            # (galva-hp's ``differentiable_all_to_all_many``); per-rank buffer S/sp of 3 and of 1 activations
            count = 3.0 if c.checkpoint else 2.0
            group = groups.setdefault(("all_to_all", c.tp, c.consecutive, False, True), [])
            group += [(i, 3.0 / c.tp, count), (i, 1.0 / c.tp, count)]
    for op, size, consecutive, i, scale, count in expert_costs.comm_groups(layer, candidates):
        groups.setdefault((op, size, consecutive, True, True), []).append((i, scale, count))
    return [
        (
            op,
            size,
            consecutive,
            np.array([m[0] for m in members]),
            np.array([m[1] for m in members]),
            np.array([m[2] for m in members]),
            expert,
            busy,
        )
        for (op, size, consecutive, expert, busy), members in groups.items()
    ]


def _overhead_ms(layer: LayerTypeProfile, c: Candidate, megatron_sp: bool) -> tuple[float, float]:
    """(forward, backward) ms the candidate's parallel form costs per call beyond the plain layer (the profile's
    ``parallel_overhead_ms``; 0 for tp 1 and for a form or degree the profile did not time)."""
    if c.tp == 1:
        return 0.0, 0.0
    form: OverheadForm = "ulysses" if c.ulysses else ("megatron_sp" if megatron_sp else "tp")
    return layer.parallel_overhead_ms.get(form, {}).get(c.tp, (0.0, 0.0))


def _sharded_ms(layer: LayerTypeProfile, c: Candidate, degree: int) -> tuple[float, float, float, float]:
    """(forward, backward, step, accumulating backward) ms a ZeRO layer sharded over ``degree`` ranks costs beyond
    the plain layer (the profile's ``sharded_overhead_ms`` and ``sharded_accumulate_ms`` at that degree, else at the
    largest profiled degree below it: FSDP2's per-call work and the DTensor step grow with the tensors, not the
    group; the accumulating backward is the reducing one where not profiled); 0 for ddp, one rank and unprofiled
    types."""
    form: ShardedForm = "zero3" if c.dp_type is ZERO3 else "zero2"
    by_degree = layer.sharded_overhead_ms.get(form, {}) if c.dp_type in (ZERO2, ZERO3) else {}
    below = [d for d in by_degree if d <= degree]
    if degree <= 1 or not below:
        return 0.0, 0.0, 0.0, 0.0
    forward, backward, step = by_degree[max(below)]
    return forward, backward, step, layer.sharded_accumulate_ms.get(form, {}).get(max(below), backward)


def _layer_forward_seconds(layer: LayerTypeProfile, batch: np.ndarray) -> np.ndarray:
    return forward_seconds(layer.forward_time, batch, layer.seq_length)


def forward_seconds(
    model: StaticTime | BatchTime | SequenceTime, batch: np.ndarray | float, seq_length: int
) -> np.ndarray:
    """Forward seconds of a profile's time model (a layer type's or the vocabulary layers') at ``batch`` samples."""
    batch = np.asarray(batch, dtype=float)
    if isinstance(model, StaticTime):
        ms = model.ms_per_sample * batch
    elif isinstance(model, BatchTime):
        ms = np.maximum(0.0, model.slope_ms_per_sample * batch + model.intercept_ms)
    elif isinstance(model, SequenceTime):
        a, b, c = model.coefficients
        ms = max(0.0, a * seq_length**2 + b * seq_length + c) * batch
    else:  # pragma: no cover - schema guarantees one of the three
        ms = np.array([model.forward_ms(float(x), seq_length) for x in batch.ravel()]).reshape(batch.shape)
    return ms * 1e-3
