"""Costs of the vocabulary layers (embedding, final norm, head): which plans a profile allows, their time and memory
on the stages that hold them (docs/cost-model.md §3, §4), and re-sharding between them and the first and last layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np

from galva_comm.layout import ranks_per_stage, sharding_group_shape
from galva_schema import CollectiveCall, DataParallelType, HardwareProfile, ModelProfile, VocabForm, VocabMemory
from galva_search.collectives import MIB, Collectives
from galva_search.compute_speed import compute_scale
from galva_search.cost_settings import CostSettings
from galva_search.layer_costs import forward_seconds
from galva_search.space import Candidate
from galva_search.states import state_bytes_per_parameter, state_fraction
from galva_search.transitions import vocab_boundaries_per_sample, vocab_boundary_calls, vocab_layout

ZERO2 = DataParallelType.ZERO2
ZERO3 = DataParallelType.ZERO3
Part = Literal["embedding", "head"]
_PRICE = {"all_reduce": "allreduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
          "all_to_all": "all_to_all"}  # a recorded call's op -> the Collectives method that prices it


def _at_degree(by_degree: dict[int, VocabForm], degree: int) -> VocabForm | None:
    """The form profiled at ``degree``, else at the largest degree below it (FSDP2's work per call grows with the
    tensors, not the group); None for one rank or none profiled."""
    below = [d for d in by_degree if d <= degree]
    return by_degree[max(below)] if degree > 1 and below else None


@dataclass(frozen=True)
class VocabOption:
    """How the vocabulary layers (embedding, final norm, head) are parallelised inside a stage."""

    tp: int = 1
    sp: bool = False  # sequence split (Ulysses-style) of degree tp instead of vocabulary tensor parallel
    zero3: bool = False  # ZeRO-3 for the vocabulary layers (the reference's embed_sdp)
    cp: int = 1  # context parallelism: each rank embeds and scores its two chunks of the sequence

    def label(self) -> str:
        cp = f"-cp{self.cp}" if self.cp > 1 else ""
        return f"v{'sp' if self.sp else 'tp'}{self.tp}{'-f' if self.zero3 else ''}{cp}"


@dataclass(frozen=True)
class VocabTerms:
    """Costs of the vocabulary layers held by one pipeline stage (scalars)."""

    micro_batch_s: float
    exposed_sync_s: float
    memory_mib: float  # states + activations of the in-flight micro-batches
    states_mib: float = 0.0
    activation_mib: float = 0.0  # activations of ONE micro-batch
    weight_grad_s: float = 0.0  # weight-gradient (W) share of the backward per micro-batch (zb-h1)
    step_s: float = 0.0  # once per iteration: the optimizer step of these layers' parameters (measured; else 0)
    regather_s: float = 0.0  # ZeRO-2: the all-gather repeated before every micro-batch's forward (LayerTerms')


class VocabCosts:
    """The vocabulary layers' plans and costs for one model profile on one hardware profile."""

    def __init__(
        self, hardware: HardwareProfile, model: ModelProfile, settings: CostSettings, comm: Collectives
    ) -> None:
        self.hardware = hardware
        self.model = model
        self.settings = settings
        self.comm = comm
        self.world_size = hardware.cluster.world_size
        self._compute_scale = compute_scale(hardware, model)  # the model profile ran alone (docs §3)
        # per (option, candidates): seconds per sample into and out of the layers, then the calls' seconds
        self._boundary_cache: dict[tuple[VocabOption, tuple[Candidate, ...]], tuple[np.ndarray, ...]] = {}

    def options(
        self, pp: int, max_tp: int, *, allow_sp: bool, allow_zero3: bool, allow_tp: bool = True, max_cp: int = 1
    ) -> list[VocabOption]:
        """Every vocabulary plan whose profile entries exist, for pipeline degree ``pp`` (context parallelism up to
        ``max_cp`` beside each: its memory is the profiled one over ``cp``)."""
        vocab = self.model.vocab
        stage_ranks = ranks_per_stage(self.world_size, pp)
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
                        cp = 1
                        while cp <= max_cp and k * cp <= stage_ranks:
                            out.append(VocabOption(k, sp, z3, cp))
                            cp *= 2
            k *= 2
        return out

    def terms(
        self, pp: int, option: VocabOption, micro_batch: int, num_micro_batches: int, in_flight: Sequence[float]
    ) -> list[VocabTerms]:
        """Vocabulary costs per stage (``pp`` entries; stages in the middle hold none).

        ``in_flight[s]`` is the number of micro-batches whose activations stage ``s`` holds at its peak.
        """
        vocab = self.model.vocab
        s = self.settings
        comm = self.comm
        stage_ranks = ranks_per_stage(self.world_size, pp)
        k, cp = option.tp, option.cp
        dp = stage_ranks // (k * cp)
        local = micro_batch / dp
        types = self.model.layer_types
        f = s.factors
        scale = f.compute * self._compute_scale
        forward = float(forward_seconds(vocab.forward_time, local / (k * cp), types[-1].seq_length)) * scale
        backward = (  # measured beside the forward where profiled, else the coefficient's multiple of it
            float(forward_seconds(vocab.backward_time, local / (k * cp), types[-1].seq_length)) * scale
            if vocab.backward_time is not None
            else s.backward_coefficient * forward
        )
        dp_type = ZERO3 if option.zero3 else s.default_dp_type
        shard, consecutive = sharding_group_shape(stage_ranks, k, True, option.sp)  # vocabulary groups are blocks
        accumulating = num_micro_batches > 1
        e = s.element_bytes
        profile_bytes = state_bytes_per_parameter(self.model.precision, s.state_accounting)

        tp_form = vocab.forms.get("tp", {}).get(k) if k > 1 and not option.sp else None
        zero3_form = _at_degree(vocab.forms.get("zero3", {}), shard) if dp_type is ZERO3 else None

        def extra(form: VocabForm | None, parts: tuple[Part, ...], index: int) -> float:
            """Seconds the form's ``parts`` spend beyond the plain modules: forward, backward or step (``index``)."""
            if form is None:
                return 0.0
            return sum(form.part(p).overhead_ms[index] for p in parts) * 1e-3 * scale

        def calls(
            form: VocabForm, parts: tuple[Part, ...], n: int, blocks: bool, keep: Callable[[CollectiveCall], bool]
        ) -> float:
            """Seconds of the form's recorded calls that ``keep`` selects, priced over ``n`` ranks (``blocks``:
            consecutive ones)."""
            priced = [
                float(getattr(comm, _PRICE[c.op])(n, blocks, c.nbytes(local / cp)))
                for p in parts for c in form.part(p).calls if keep(c)
            ]  # fmt: skip
            return sum(priced)

        def position(
            memory: VocabMemory, parts: tuple[Part, ...], share: float, tp_messages: int, seq: int, hidden: int,
            n: float,
        ) -> VocabTerms:
            fwd = forward * share + extra(tp_form, parts, 0) + extra(zero3_form, parts, 0)
            bwd = backward * share + extra(tp_form, parts, 1) + extra(zero3_form, parts, 1)
            tp_time = 0.0
            if tp_form is not None:  # the form's own calls, as the profiler recorded them
                tp_time = calls(tp_form, parts, k, True, lambda c: True) * f.tp_comm
            elif k > 1 and not option.sp:
                tp_time = tp_messages * float(comm.allreduce(k, True, local * seq / cp * hidden * e)) * f.tp_comm
            # the profile's states are at its own precision: parameters per rank, then this plan's bytes for them
            parameters = memory.model_states_mib[1 if option.sp else k] * MIB / profile_bytes
            states_full = parameters * sum(s.state_bytes) / MIB
            states = states_full * float(
                state_fraction(dp_type, shard, accumulating, precision=s.precision, accounting=s.state_accounting)
            ) * f.states
            grad_bytes = parameters * s.state_bytes[1]  # reduced in the dtype the runtime keeps gradients in
            sync = gather = 0.0
            if shard > 1 and dp_type in (ZERO2, ZERO3):
                gather = float(comm.all_gather(shard, consecutive, parameters * e)) * f.dp_comm
                sync = float(comm.reduce_scatter(shard, consecutive, grad_bytes)) * f.dp_comm + gather
            elif shard > 1:
                sync = float(comm.allreduce(shard, consecutive, grad_bytes)) * f.dp_comm
            if zero3_form is not None:  # a unit per module: its gathers and reduce-scatter as recorded
                on_shard = partial(calls, zero3_form, parts, shard, consecutive)
                gather = on_shard(lambda c: not c.backward) * f.dp_comm
                gather_bwd = on_shard(lambda c: c.backward and c.op == "all_gather") * f.dp_comm
                reduce = on_shard(lambda c: c.backward and c.op != "all_gather") * f.dp_comm
                overlapped_gather = float(comm.overlapped(bwd, gather_bwd))
                micro = fwd + tp_time + gather + overlapped_gather
                exposed = float(comm.overlapped(bwd, gather_bwd + reduce)) - overlapped_gather
            elif dp_type is ZERO3:  # as a ZeRO-3 layer: gathers every micro-batch, reduce-scatter in the last one
                gather_bwd = float(comm.overlapped(bwd, gather))
                micro = fwd + tp_time + gather + gather_bwd
                exposed = float(comm.overlapped(bwd, sync)) - gather_bwd
            else:
                micro = fwd + bwd + tp_time
                exposed = float(comm.overlapped(bwd, sync)) - bwd
            act = memory.activation_mib_per_sample[k] / cp * local * f.activations
            step = extra(zero3_form, parts, 2)
            if vocab.optimizer_step_ms is not None:  # its tensors' share, and the elements this rank steps
                fixed, per_million = vocab.optimizer_step_ms
                local_parameters = parameters / (shard if dp_type in (ZERO2, ZERO3) else 1)
                step += (fixed * share + per_million * local_parameters / 1e6) * 1e-3 * scale
            regather = gather if dp_type is ZERO2 else 0.0
            # zb-h1 defers the weight gradients' matmuls: half the plain backward, not the forms' own work
            weight_grad = 0.5 * backward * share
            return VocabTerms(micro, exposed, states + act * n, states, act, weight_grad, step, regather_s=regather)

        first, last = types[0], types[-1]
        if pp == 1:
            # embedding all-reduce and head all-reduce on the one stage; both halves of the compute
            both: tuple[Part, ...] = ("embedding", "head")
            only = position(vocab.memory_pp_off, both, 1.0, 2, last.seq_length, last.hidden_size, in_flight[0])
            return [only]
        empty = VocabTerms(0.0, 0.0, 0.0)
        out = [empty] * pp
        out[0] = position(
            vocab.memory_pp_first, ("embedding",), 0.5, 1, first.seq_length, first.hidden_size, in_flight[0]
        )
        out[-1] = position(vocab.memory_pp_last, ("head",), 0.5, 1, last.seq_length, last.hidden_size, in_flight[-1])
        return out

    def boundaries(
        self, option: VocabOption, candidates: Sequence[Candidate], micro_batch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Seconds per micro-batch to re-shard from the embedding into the first layer, and from the last layer into
        the head, per candidate of that layer (zero where the layouts agree)."""
        candidates = tuple(candidates)
        key = (option, candidates)
        hit = self._boundary_cache.get(key)
        if hit is None:
            pp = candidates[0].pp if candidates else 1
            first, last = self.model.layer_types[0], self.model.layer_types[-1]
            e = self.settings.element_bytes
            stage_ranks = ranks_per_stage(self.world_size, pp)
            layout = vocab_layout(option.tp, option.sp, self.settings.megatron_sp, option.cp)
            per_sample = vocab_boundaries_per_sample(
                self.comm,
                candidates,
                stage_ranks,
                self.settings.megatron_sp,
                layout,
                first.seq_length * first.hidden_size * e,
                last.seq_length * last.hidden_size * e,
            )
            calls = vocab_boundary_calls(self.comm, candidates, stage_ranks, self.settings.megatron_sp, layout)
            hit = (*per_sample, *calls)
            self._boundary_cache[key] = hit
        factor = self.settings.factors.redistribution
        return (hit[0] * micro_batch + hit[2]) * factor, (hit[1] * micro_batch + hit[3]) * factor
