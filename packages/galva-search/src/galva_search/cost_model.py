"""Time and memory of layers, vocabulary layers and whole iterations (docs/cost-model.md has every formula).

Units: seconds for time, MiB (2**20 bytes) for memory, bytes for messages, GB/s = 1e9 bytes/s for bandwidth.
Everything is computed for a *list* of candidate strategies at once (numpy arrays indexed by candidate), so that a
search builds one table per (layer type, pipeline degree, micro-batch size) and never loops over strategies in
Python inside the dynamic programme.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from galva_schema import (
    BatchTime,
    Calibration,
    DataParallelType,
    HardwareProfile,
    LayerTypeProfile,
    ModelProfile,
    ParallelForm,
    PipelineSchedule,
    Precision,
    SchemaError,
    SequenceTime,
    StaticTime,
    VocabMemory,
)
from galva_schema.constraints import head_problem
from galva_schema.sharding import sequence_shards
from galva_search.collectives import MIB, Collectives
from galva_search.space import Candidate
from galva_search.transitions import (
    redistribution_per_sample,
    switch_penalty,
    vocab_boundaries_per_sample,
    vocab_layout,
)

ZERO2 = DataParallelType.ZERO2
ZERO3 = DataParallelType.ZERO3
STATE_ACCOUNTINGS = ("reference", "galva-hp")
"""Values of :attr:`CostSettings.state_accounting`."""
# (compute parameter, gradient, master + Adam) bytes per parameter under ddp, by (accounting, fp32)
_STATE_BYTES = {
    ("reference", False): (2, 2, 12),  # bf16 parameter and gradient, fp32 master + Adam m, v
    ("reference", True): (4, 4, 8),
    ("galva-hp", False): (2, 4, 12),  # galva-hp keeps the gradient in fp32 (master gradient / FSDP2 reduce dtype)
    ("galva-hp", True): (4, 4, 8),
}


def state_bytes_per_parameter(precision: Precision, accounting: str = "galva-hp") -> int:
    """Model-state bytes per unsharded parameter (ddp) with AdamW: 16, or 18 for galva-hp in bf16 (docs §4).

    The profiler writes the vocabulary layers' ``model_states_mib`` as galva-hp holds them at its precision.
    """
    return sum(_STATE_BYTES[accounting, precision is Precision.FP32])


@dataclass(frozen=True)
class TermFactors:
    """Per-term correction factors (a :class:`galva_schema.Calibration` fitted by ``galva-profile check``).

    Each multiplies one family of terms of the cost model; 1.0 everywhere is the uncalibrated model.
    """

    compute: float = 1.0  # forward, backward and recomputation of layers and vocabulary layers
    tp_comm: float = 1.0  # Megatron tp / Megatron-SP / Ulysses collectives, vocabulary tp
    dp_comm: float = 1.0  # gradient synchronisation and ZeRO-3 gathers
    p2p: float = 1.0  # pipeline sends
    redistribution: float = 1.0  # re-sharding between layers of different layouts
    states: float = 1.0  # model-state bytes
    activations: float = 1.0  # activation bytes (kept and transient)

    @classmethod
    def from_calibration(cls, calibration: Calibration) -> TermFactors:
        t, m = calibration.time_factors, calibration.memory_factors
        return cls(t.compute, t.tp_comm, t.dp_comm, t.p2p, t.redistribution, m.states, m.activations)


@dataclass(frozen=True)
class CostSettings:
    """Training settings the cost model needs; defaults follow the reference (§4 ``TrainArgs``/``ParallelArgs``)."""

    precision: Precision = Precision.BF16
    backward_coefficient: float = 2.0  # backward compute time = coefficient * forward compute time
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    default_dp_type: DataParallelType = DataParallelType.DDP
    megatron_sp: bool = False
    context_mib: float = 1024.0  # framework/CUDA context and allocator overhead per device
    # model-state bytes per parameter: "galva-hp" (what galva-hp holds, measured by galva-profile check: bf16
    # 2 + 4 + 12 and FSDP2's peaks; docs §4), the default since galva-hp runs the plans, or "reference" (bf16
    # 2 + 2 + 12, the reference's formulas: under-counts galva-hp's bf16 ddp states by 11%)
    state_accounting: str = "galva-hp"
    switch_penalty_s: float = 1e-9  # additive tie-breaker per change of dp type or checkpointing between layers
    factors: TermFactors = TermFactors()  # calibration (galva-search --calibration FILE)

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation, gradient or compute-copy parameter element."""
        return self.precision.bytes_per_element

    @property
    def state_bytes(self) -> tuple[int, int, int]:
        """Bytes per parameter of (compute parameters, gradients, optimizer states incl. fp32 master weights) that
        galva-hp holds under ddp; their sum is what one unsharded parameter costs (:func:`state_bytes_per_parameter`).

        fp32 with Adam: 4 + 4 + (4 + 4) = 16. bf16: 2 + 4 + (4 master + 4 + 4) = 18: the gradient a rank keeps is
        fp32 (ddp units reduce into the fp32 master's gradient, FSDP2 accumulates and reduce-scatters in its fp32
        ``reduce_dtype``), as Megatron-LM's 18 bytes, not the 2 + 2 + 12 = 16 of the reference (docs §4).
        """
        return _STATE_BYTES[self.state_accounting, self.precision is Precision.FP32]

    def __post_init__(self) -> None:
        if self.state_accounting not in STATE_ACCOUNTINGS:
            raise ValueError(f"state accounting {self.state_accounting!r} is not one of {', '.join(STATE_ACCOUNTINGS)}")


@dataclass(frozen=True)
class VocabOption:
    """How the vocabulary layers (embedding, final norm, head) are parallelised inside a stage."""

    tp: int = 1
    sp: bool = False  # sequence split (Ulysses-style) of degree tp instead of vocabulary tensor parallel
    zero3: bool = False  # ZeRO-3 for the vocabulary layers (the reference's embed_sdp)

    def label(self) -> str:
        return f"v{'sp' if self.sp else 'tp'}{self.tp}{'-f' if self.zero3 else ''}"


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
    # weight-gradient (W) share of backward_s, the work zb-h1 defers into the bubble: half the backward compute
    # without recomputation (a matmul's input-gradient and weight-gradient cost the same FLOPs; docs §7)
    weight_grad_s: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def memory_mib(self, in_flight: float) -> np.ndarray:
        return self.states_mib + in_flight * self.activation_mib


@dataclass(frozen=True)
class _LayerStatic:
    tp: np.ndarray
    dp: np.ndarray
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
    penalty: np.ndarray


@dataclass(frozen=True)
class VocabTerms:
    """Costs of the vocabulary layers held by one pipeline stage (scalars)."""

    micro_batch_s: float
    exposed_sync_s: float
    memory_mib: float  # states + activations of the in-flight micro-batches
    states_mib: float = 0.0
    activation_mib: float = 0.0  # activations of ONE micro-batch
    weight_grad_s: float = 0.0  # weight-gradient (W) share of the backward per micro-batch (zb-h1)


class CostModel:
    """Cost model of one model profile on one hardware profile. See docs/cost-model.md."""

    def __init__(
        self,
        hardware: HardwareProfile,
        model: ModelProfile,
        settings: CostSettings = CostSettings(),
        *,
        hardware_source: str | None = None,
        model_source: str | None = None,
    ) -> None:
        self.hardware = hardware
        self.model = model
        self.settings = settings
        self.comm = Collectives(hardware, hardware_source)
        self.model_source = model_source
        self.world_size = hardware.cluster.world_size
        self._static_cache: dict[tuple[int, tuple[Candidate, ...]], _LayerStatic] = {}
        self._vocab_boundary_cache: dict[tuple[VocabOption, tuple[Candidate, ...]], tuple[np.ndarray, np.ndarray]] = {}

    # ----------------------------------------------------------------------------------------------- helpers
    def _error(self, message: str) -> SchemaError:
        return SchemaError(message, source=self.model_source)

    def activation_per_sample(self, type_index: int, candidates: Sequence[Candidate]) -> np.ndarray:
        """Activation MiB per local sample kept for backward by each candidate (before in-flight multiplication)."""
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
                    raise self._error(
                        f"layer_types[{type_index}].activation_mib_per_sample: no entry for tp {c.tp} "
                        f"(layer type {layer.name!r}); profile it or lower --max-tp"
                    )
                else:
                    out[i] = table[c.tp]
        return out

    def _runs_tp(self, type_index: int, tp: int) -> bool:
        """Whether the model's constraints (if the profile has them) let this layer type run Megatron tp ``tp``."""
        constraints = self.model.constraints
        if constraints is None:
            return True
        own = constraints.layer_types[type_index]
        return ParallelForm.TP not in own.unsupported and head_problem(own, tp, ulysses=False) is None

    def state_fraction(self, dp_type: DataParallelType, shard: np.ndarray | int, accumulating: bool) -> np.ndarray:
        """Share of the unsharded (ddp) model-state bytes one rank holds under ``dp_type`` over ``shard`` ranks.

        ``state_accounting`` "reference" keeps the reference's formulas (below in the code). "galva-hp" is what
        galva-hp holds at its peak (``galva-profile check`` measures it; docs/cost-model.md §4), with
        ``(p, q, o)`` = :attr:`CostSettings.state_bytes` and ``d`` = ``shard``:

        * ddp, or any type over one rank (galva-hp wraps a one-rank group as ddp): ``p + q + o``;
        * ZeRO-2: the gathered compute copy ``p`` stays until the layer's backward is done and master weights and
          Adam states are sharded, ``o/d``; gradients accumulated over several micro-batches are a full-size buffer
          ``q``; with one micro-batch the gradient shard appears as the gathered copy goes, so the peak holds
          ``max(p, q/d)`` of the two. In fp32 the parameter shard is kept beside the gathered copy (``p/d`` more,
          the gathered copy is no master); in bf16 that shard is the master, inside ``o``;
        * ZeRO-3: parameters at rest are the shards (fp32: ``p/d``; bf16: the master, in ``o/d``; the gathered
          compute copy is a transient, ``gather_mib``), gradients ``q/d``, or ``q`` while accumulating.
        """
        p_b, g_b, o_b = self.settings.state_bytes
        fp32 = self.settings.precision is Precision.FP32
        d = np.asarray(shard, dtype=float)
        inv = 1.0 / d
        if self.settings.state_accounting == "reference":
            # p sharded by ZeRO-3 only, o by ZeRO-2/3, q by ZeRO-2/3 unless accumulating (a full-size buffer, the
            # reference's async_grad_reduce); fp32 ZeRO-2 accumulating keeps the parameter shard too (p/d more)
            zero = dp_type in (ZERO2, ZERO3)
            p = inv if dp_type is ZERO3 else (1.0 + inv if dp_type is ZERO2 and accumulating and fp32 else 1.0)
            g = inv if zero and not accumulating else 1.0
            o = inv if zero else 1.0
            return np.asarray((p_b * p + g_b * g + o_b * o) / (p_b + g_b + o_b))
        if dp_type is ZERO2 and accumulating:
            held = p_b * (1.0 + inv if fp32 else 1.0) + g_b
        elif dp_type is ZERO2:  # fp32: p + q/d (the shard counted once); bf16: max(p, q/d), p for d >= 2
            held = p_b + g_b * inv if fp32 else np.maximum(p_b, g_b * inv)
        elif dp_type is ZERO3:
            held = (p_b * inv if fp32 else 0.0 * d) + (g_b if accumulating else g_b * inv)
        else:
            held = (p_b + g_b) * np.ones_like(d)
        held = held + (o_b * inv if dp_type in (ZERO2, ZERO3) else o_b)
        total = p_b + g_b + o_b
        return np.asarray(np.where(d <= 1.0, 1.0, held / total))

    # ----------------------------------------------------------------------------------------------- layers
    def _static(self, type_index: int, candidates: tuple[Candidate, ...]) -> _LayerStatic:
        """Parts of the layer costs that do not depend on the micro-batch size (cached per candidate list)."""
        key = (type_index, candidates)
        hit = self._static_cache.get(key)
        if hit is not None:
            return hit
        layer = self.model.layer_types[type_index]
        s = self.settings
        comm = self.comm
        n = len(candidates)
        tp_degree = np.array([c.tp_degree for c in candidates], dtype=float)
        e = s.element_bytes
        grad_bytes = layer.parameter_mib * MIB / 4.0 / tp_degree * e  # parameter_mib is fp32 bytes
        sync = np.zeros(n)
        gather = np.zeros(n)
        p2p_per_byte = np.zeros(n)
        groups: dict[tuple[str, int, bool], list[tuple[int, float, float]]] = {}
        pp = candidates[0].pp if candidates else 1
        for i, c in enumerate(candidates):
            if c.tp > 1 and not c.ulysses and s.megatron_sp:
                # 2 all-gather + reduce-scatter pairs forward, 2 backward, 2 more when recomputing, each priced by its
                # own measured curve (latency included); without the curves a pair is one all-reduce, as below
                count = 6.0 if c.checkpoint else 4.0
                groups.setdefault(("all_gather", c.tp, c.consecutive), []).append((i, 1.0, count))
                groups.setdefault(("reduce_scatter", c.tp, c.consecutive), []).append((i, 1.0, count))
            elif c.tp > 1 and not c.ulysses:
                # 2 all-reduces forward, 2 backward, 2 more when recomputing
                groups.setdefault(("allreduce", c.tp, c.consecutive), []).append((i, 1.0, 6.0 if c.checkpoint else 4.0))
            elif c.ulysses:
                # 4 all-to-alls (q, k, v, output) forward, 4 backward, 4 more when recomputing; per-rank buffer S/sp
                groups.setdefault(("all_to_all", c.tp, c.consecutive), []).append(
                    (i, 1.0 / c.tp, 12.0 if c.checkpoint else 8.0)
                )
            if c.shard_degree > 1:
                d, consecutive = c.shard_degree, self.dp_group_consecutive(c)
                if c.dp_type in (ZERO2, ZERO3):  # reduce-scatter + all-gather, each with its own measured latency
                    gather[i] = comm.all_gather(d, consecutive, grad_bytes[i])
                    sync[i] = comm.reduce_scatter(d, consecutive, grad_bytes[i]) + gather[i]
                else:
                    sync[i] = comm.allreduce(d, consecutive, grad_bytes[i])
            if pp > 1:
                shards = sequence_shards(c.tp, ulysses=c.ulysses, megatron_sp=s.megatron_sp)
                p2p_per_byte[i] = comm.p2p(pp, 1.0) / shards
        comm_groups = [
            (
                op,
                size,
                consecutive,
                np.array([m[0] for m in members]),
                np.array([m[1] for m in members]),
                np.array([m[2] for m in members]),
            )
            for (op, size, consecutive), members in groups.items()
        ]
        zero3 = np.array([c.dp_type is ZERO3 for c in candidates])
        params_mib = layer.parameter_mib / tp_degree
        total_state_bytes = sum(s.state_bytes)
        recompute = np.zeros(n)
        if any(c.checkpoint for c in candidates):
            plain = [replace(c, checkpoint=False) for c in candidates]
            full = self.activation_per_sample(type_index, plain)
            recompute = np.where([c.checkpoint for c in candidates], full, 0.0)
        states = np.empty((2, n))
        for accumulating in (0, 1):
            for i, c in enumerate(candidates):
                frac = self.state_fraction(c.dp_type, c.shard_degree, bool(accumulating))
                states[accumulating, i] = params_mib[i] / 4.0 * total_state_bytes * frac
        static = _LayerStatic(
            tp=np.array([c.tp for c in candidates], dtype=float),
            dp=np.array([c.dp for c in candidates], dtype=float),
            checkpoint=np.array([c.checkpoint for c in candidates]),
            zero3=zero3,
            sync=sync,
            gather=gather,
            p2p_per_byte=p2p_per_byte,
            comm_groups=comm_groups,
            states=states,
            activation_per_sample=self.activation_per_sample(type_index, candidates),
            recompute_per_sample=recompute,
            gather_mib=np.where(zero3, params_mib / 4.0 * s.element_bytes, 0.0),
            redistribution_per_sample=redistribution_per_sample(
                comm, candidates, self.world_size // pp, s.megatron_sp, layer.seq_length * layer.hidden_size * e
            ),
            penalty=switch_penalty(candidates, s.switch_penalty_s),
        )
        self._static_cache[key] = static
        return static

    def layer_terms(
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
        forward = _forward_seconds(layer, local / st.tp) * (f.compute * self.hardware.compute_slowdown)
        recompute = np.where(st.checkpoint, forward, 0.0)
        backward = s.backward_coefficient * forward + recompute
        act_bytes = local * layer.seq_length * layer.hidden_size * s.element_bytes
        tp_comm = np.zeros(len(candidates))
        for op, size, consecutive, index, scale, count in st.comm_groups:
            per = getattr(comm, op)(size, consecutive, act_bytes[index] * scale)
            tp_comm[index] += per * count * f.tp_comm
        sync = st.sync * f.dp_comm
        # ZeRO-3, every micro-batch: all-gather before forward (exposed), all-gather overlapped with backward.
        # Its reduce-scatter runs in the last micro-batch only (FSDP2 without gradient sync before it): once per
        # iteration, overlapped with that backward together with the all-gather (docs/cost-model.md §3).
        gather = st.gather * f.dp_comm
        gather_bwd = comm.overlapped(backward, gather)
        zero3_wall = np.where(st.zero3, gather + gather_bwd - backward, 0.0)
        micro = forward + backward + tp_comm + zero3_wall
        exposed = np.where(
            st.zero3, comm.overlapped(backward, sync) - gather_bwd, comm.overlapped(backward, sync) - backward
        )
        act = (local * st.activation_per_sample + np.where(st.checkpoint, 0.0, layer.activation_mib_per_call)) * (
            f.activations
        )
        transient = local * st.recompute_per_sample * f.activations + 2.0 * st.gather_mib * f.states
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
            weight_grad_s=0.5 * s.backward_coefficient * forward,
        )

    def redistribution(self, type_index: int, candidates: Sequence[Candidate], micro_batch: int) -> np.ndarray:
        """``[S][S]`` seconds per micro-batch to move activations (forward) and their gradients (backward) from a
        layer under candidate ``i`` to the next layer, of type ``type_index``, under candidate ``j``
        (:mod:`galva_search.transitions`: what galva_comm's redistribution plans move)."""
        factor = self.settings.factors.redistribution
        return self._static(type_index, tuple(candidates)).redistribution_per_sample * (micro_batch * factor)

    def switch_penalties(self, type_index: int, candidates: Sequence[Candidate]) -> np.ndarray:
        """``[S][S]`` tie-breaker seconds between neighbours (:func:`galva_search.transitions.switch_penalty`)."""
        return self._static(type_index, tuple(candidates)).penalty

    def vocab_boundaries(
        self, option: VocabOption, candidates: Sequence[Candidate], micro_batch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Seconds per micro-batch to re-shard from the embedding into the first layer, and from the last layer into
        the head, per candidate of that layer (zero where the layouts agree)."""
        candidates = tuple(candidates)
        key = (option, candidates)
        hit = self._vocab_boundary_cache.get(key)
        if hit is None:
            pp = candidates[0].pp if candidates else 1
            first, last = self.model.layer_types[0], self.model.layer_types[-1]
            e = self.settings.element_bytes
            hit = vocab_boundaries_per_sample(
                self.comm,
                candidates,
                self.world_size // pp,
                self.settings.megatron_sp,
                vocab_layout(option.tp, option.sp, self.settings.megatron_sp),
                first.seq_length * first.hidden_size * e,
                last.seq_length * last.hidden_size * e,
            )
            self._vocab_boundary_cache[key] = hit
        scale = micro_batch * self.settings.factors.redistribution
        return hit[0] * scale, hit[1] * scale

    def dp_group_consecutive(self, c: Candidate) -> bool:
        """Layout of the group that syncs gradients: the whole stage (consecutive) for tp 1 and Ulysses layers;
        otherwise strided when the tp group is consecutive, and the other way round."""
        if c.ulysses or c.tp == 1:
            return True
        return not c.consecutive

    # ----------------------------------------------------------------------------------------------- vocabulary
    def vocab_options(
        self, pp: int, max_tp: int, *, allow_sp: bool, allow_zero3: bool, allow_tp: bool = True
    ) -> list[VocabOption]:
        """Every vocabulary plan whose profile entries exist, for pipeline degree ``pp``."""
        vocab = self.model.vocab
        stage_ranks = self.world_size // pp
        positions = [vocab.memory_pp_off] if pp == 1 else [vocab.memory_pp_first, vocab.memory_pp_last]
        out: list[VocabOption] = []
        k = 1
        while k <= min(stage_ranks, max_tp if allow_tp else 1):
            for sp in (False, True) if k > 1 else (False,):
                if sp and not allow_sp:
                    continue
                states_key = 1 if sp else k
                if all(states_key in m.model_states_mib and k in m.activation_mib_per_sample for m in positions):
                    for z3 in (False, True) if allow_zero3 else (False,):
                        out.append(VocabOption(k, sp, z3))
            k *= 2
        return out

    def vocab_terms(
        self, pp: int, option: VocabOption, micro_batch: int, num_micro_batches: int, in_flight: Sequence[float]
    ) -> list[VocabTerms]:
        """Vocabulary costs per stage (``pp`` entries; stages in the middle hold none).

        ``in_flight[s]`` is the number of micro-batches whose activations stage ``s`` holds at its peak.
        """
        vocab = self.model.vocab
        s = self.settings
        comm = self.comm
        stage_ranks = self.world_size // pp
        k = option.tp
        dp = stage_ranks // k
        local = micro_batch / dp
        types = self.model.layer_types
        f = s.factors
        compute_scale = f.compute * self.hardware.compute_slowdown  # the model profile ran alone (docs §3)
        forward = float(_forward_seconds_vocab(vocab.forward_time, local / k, types[-1].seq_length)) * compute_scale
        dp_type = ZERO3 if option.zero3 else s.default_dp_type
        shard = stage_ranks if option.sp else dp
        consecutive = option.sp or k == 1
        accumulating = num_micro_batches > 1
        e = s.element_bytes
        profile_bytes = state_bytes_per_parameter(self.model.precision, s.state_accounting)

        def position(
            memory: VocabMemory, share: float, tp_messages: int, seq: int, hidden: int, n: float
        ) -> VocabTerms:
            fwd = forward * share
            bwd = s.backward_coefficient * fwd
            tp_time = 0.0
            if k > 1 and not option.sp:
                tp_time = tp_messages * float(comm.allreduce(k, True, local * seq * hidden * e)) * f.tp_comm
            # the profile's states are at its own precision: parameters per rank, then this plan's bytes for them
            parameters = memory.model_states_mib[1 if option.sp else k] * MIB / profile_bytes
            states_full = parameters * sum(s.state_bytes) / MIB
            states = states_full * float(self.state_fraction(dp_type, shard, accumulating)) * f.states
            grad_bytes = parameters * e
            sync = gather = 0.0
            if shard > 1 and dp_type in (ZERO2, ZERO3):
                gather = float(comm.all_gather(shard, consecutive, grad_bytes)) * f.dp_comm
                sync = float(comm.reduce_scatter(shard, consecutive, grad_bytes)) * f.dp_comm + gather
            elif shard > 1:
                sync = float(comm.allreduce(shard, consecutive, grad_bytes)) * f.dp_comm
            if dp_type is ZERO3:  # as a ZeRO-3 layer: gathers every micro-batch, reduce-scatter in the last one
                gather_bwd = float(comm.overlapped(bwd, gather))
                micro = fwd + tp_time + gather + gather_bwd
                exposed = float(comm.overlapped(bwd, sync)) - gather_bwd
            else:
                micro = fwd + bwd + tp_time
                exposed = float(comm.overlapped(bwd, sync)) - bwd
            act = memory.activation_mib_per_sample[k] * local * f.activations
            return VocabTerms(micro, exposed, states + act * n, states, act, 0.5 * bwd)

        first, last = types[0], types[-1]
        if pp == 1:
            # embedding all-reduce and head all-reduce on the one stage; both halves of the compute
            only = position(vocab.memory_pp_off, 1.0, 2, last.seq_length, last.hidden_size, in_flight[0])
            return [only]
        empty = VocabTerms(0.0, 0.0, 0.0)
        out = [empty] * pp
        out[0] = position(vocab.memory_pp_first, 0.5, 1, first.seq_length, first.hidden_size, in_flight[0])
        out[-1] = position(vocab.memory_pp_last, 0.5, 1, last.seq_length, last.hidden_size, in_flight[-1])
        return out

    # ----------------------------------------------------------------------------------------------- pipeline
    def in_flight(
        self,
        pp: int,
        num_micro_batches: int,
        schedule: PipelineSchedule | None = None,
        virtual_stages: int = 1,
    ) -> list[float]:
        """Activations each stage holds at its peak, in micro-batches of the whole stage (the multiplier of one
        micro-batch's activations; docs/cost-model.md §4). ``schedule`` defaults to the settings' schedule.

        pp 1: one (micro-batches run one after another). GPipe: all ``c`` (every forward runs before any backward).
        1F1B: ``min(pp - s, c)`` at stage ``s``. zb-h1: ``min(pp, c)`` on every stage (1F1B's ``pp - s`` forwards
        plus the ``s`` micro-batches whose deferred weight-gradient pass still holds their inputs). Interleaved
        1F1B with ``v`` chunks: :func:`interleaved_chunks_in_flight` micro-batch-chunks, each holding ``1/v`` of the
        stage's activations.
        """
        c = num_micro_batches
        if pp == 1:
            return [1]
        schedule = self.settings.pipeline_schedule if schedule is None else schedule
        if schedule is PipelineSchedule.GPIPE:
            return [c] * pp
        if schedule is PipelineSchedule.ZB_H1:
            return [min(pp, c)] * pp
        if schedule is PipelineSchedule.INTERLEAVED_1F1B and virtual_stages > 1:
            return [n / virtual_stages for n in interleaved_chunks_in_flight(pp, c, virtual_stages)]
        return [min(pp - stage, c) for stage in range(pp)]


def interleaved_chunks_in_flight(pp: int, num_micro_batches: int, virtual_stages: int) -> list[int]:
    """Micro-batch-chunks whose activations stage ``s`` holds at its peak under Megatron's interleaved 1F1B:
    ``min(2 (pp - s - 1) + (v - 1) pp + 1, v c)`` (its warm-up forwards, then one more forward before the first
    backward; every later step runs one forward and one backward, so the count never grows again); with ``c = pp``
    every forward is a warm-up one (Megatron, galva-hp): all ``v c``."""
    v, c = virtual_stages, num_micro_batches
    if c == pp:
        return [v * c] * pp
    return [min(2 * (pp - s - 1) + (v - 1) * pp + 1, v * c) for s in range(pp)]


@dataclass(frozen=True)
class PipelineTime:
    """An iteration split into its parts (seconds): ``steady + bubble + tail = total``."""

    total: float
    steady: float  # c micro-batches of the slowest stage
    bubble: float  # fill and drain
    tail: float  # gradient synchronisation after the last backward
    slowest: int  # the stage that sets the pace


def pipeline_time(
    stage_micro_s: Sequence[float],
    stage_exposed_s: Sequence[float],
    num_micro_batches: int,
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
    virtual_stages: int = 1,
    stage_weight_grad_s: Sequence[float] | None = None,
) -> PipelineTime:
    """Seconds per iteration of a pipeline whose stage ``s`` takes ``U_s`` per micro-batch (docs §7).

    With ``k`` the slowest stage, ``T = c·U_k + bubble + tail``, the bubble being what the other stages add while
    the pipeline fills and drains:

    * 1F1B, GPipe: ``Σ_{s≠k} U_s`` (so ``T = Σ_s U_s + (c − 1)·U_k``);
    * interleaved 1F1B with ``v`` chunks per stage: ``Σ_{s≠k} U_s / v`` (fill and drain walk one chunk of each
      stage, ``1/v`` of its work; equal stages give Megatron's ``(pp − 1)·U/v``);
    * zb-h1: ``Σ_{s≠k} max(0, U_s − 2·W_s)`` with ``W_s`` the stage's weight-gradient work, deferred into the
      bubble (equal stages: the paper's ``(pp − 1)(F + B − W)``); with ``c < pp`` no stage can defer enough weight
      gradients and the 1F1B bubble is kept.

    The tail is ``max(0, max_s (E_s − lead_s))``: stage ``s`` finishes its last backward ``lead_s`` before stage 0
    (``Σ_{k<s}`` of the same per-stage bubble terms), which hides part of its exposed sync ``E_s``.
    """
    u = np.asarray(stage_micro_s, dtype=float)
    e = np.asarray(stage_exposed_s, dtype=float)
    c, pp = num_micro_batches, len(u)
    if schedule is PipelineSchedule.INTERLEAVED_1F1B and virtual_stages > 1:
        fill = u / virtual_stages
    elif schedule is PipelineSchedule.ZB_H1 and stage_weight_grad_s is not None and c >= pp:
        fill = np.maximum(0.0, u - 2.0 * np.asarray(stage_weight_grad_s, dtype=float))
    else:
        fill = u
    slowest = int(np.argmax(u))
    bubble = float(fill.sum() - fill[slowest])
    lead = np.concatenate([[0.0], np.cumsum(fill)[:-1]])
    tail = max(0.0, float(np.max(e - lead)))
    steady = float(c * u[slowest])
    return PipelineTime(steady + bubble + tail, steady, bubble, tail, slowest)


def _forward_seconds(layer: LayerTypeProfile, batch: np.ndarray) -> np.ndarray:
    return _forward_seconds_vocab(layer.forward_time, batch, layer.seq_length)


def _forward_seconds_vocab(
    model: StaticTime | BatchTime | SequenceTime, batch: np.ndarray | float, seq_length: int
) -> np.ndarray:
    """Forward seconds of the profile's time model at ``batch`` (array) samples."""
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
