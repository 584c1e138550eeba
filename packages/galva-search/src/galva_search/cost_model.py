"""The cost model of one model profile on one hardware profile: what the search and ``galva-profile check`` ask.

Units: seconds for time, MiB (2**20 bytes) for memory, bytes for messages, GB/s = 1e9 bytes/s for bandwidth;
docs/cost-model.md has every formula. :class:`CostModel` answers from the modules that own each part:

* :mod:`galva_search.cost_settings`: the training settings and the calibration's per-term factors;
* :mod:`galva_search.states`: model-state bytes and the share a rank holds under ddp, ZeRO-2 and ZeRO-3;
* :mod:`galva_search.layer_costs`: a layer's time and memory per candidate, and re-sharding between layers;
* :mod:`galva_search.vocab_costs`: the vocabulary layers' plans and costs;
* :mod:`galva_search.pipeline_costs`: activations in flight and an iteration's time under each schedule.

Their public names are importable from here too, as callers have always imported them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from galva_schema import HardwareProfile, ModelProfile, PipelineSchedule
from galva_search.collectives import Collectives
from galva_search.compute_speed import compute_scale
from galva_search.cost_settings import CostSettings, TermFactors
from galva_search.layer_costs import LayerCosts, LayerTerms
from galva_search.pipeline_costs import (
    PipelineTime,
    SharedProcessors,
    in_flight,
    interleaved_chunks_in_flight,
    pipeline_time,
    shared_pipeline_time,
)
from galva_search.space import Candidate
from galva_search.states import STATE_ACCOUNTINGS, state_bytes_per_parameter
from galva_search.vocab_costs import VocabCosts, VocabOption, VocabTerms

__all__ = [
    "STATE_ACCOUNTINGS",
    "CostModel",
    "CostSettings",
    "LayerTerms",
    "PipelineTime",
    "SharedProcessors",
    "TermFactors",
    "VocabOption",
    "VocabTerms",
    "interleaved_chunks_in_flight",
    "pipeline_time",
    "shared_pipeline_time",
    "state_bytes_per_parameter",
]

_DEFAULT_SETTINGS = CostSettings()


class CostModel:
    """Cost model of one model profile on one hardware profile. See docs/cost-model.md."""

    def __init__(
        self,
        hardware: HardwareProfile,
        model: ModelProfile,
        settings: CostSettings = _DEFAULT_SETTINGS,
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
        self._compute_scale = compute_scale(hardware, model)  # the profiles' every-rank slowdown and minutes
        self._layers = LayerCosts(hardware, model, settings, self.comm, model_source)
        self._vocab = VocabCosts(hardware, model, settings, self.comm)

    # ----------------------------------------------------------------------------------------------- layers
    def activation_per_sample(self, type_index: int, candidates: Sequence[Candidate]) -> np.ndarray:
        """Activation MiB per local sample kept for backward by each candidate (:class:`LayerCosts`)."""
        return self._layers.activation_per_sample(type_index, candidates)

    def layer_terms(
        self, type_index: int, candidates: Sequence[Candidate], micro_batch: int, num_micro_batches: int
    ) -> LayerTerms:
        """Costs of one layer of type ``type_index`` under each candidate (:meth:`LayerCosts.terms`)."""
        return self._layers.terms(type_index, candidates, micro_batch, num_micro_batches)

    def redistribution(self, type_index: int, candidates: Sequence[Candidate], micro_batch: int) -> np.ndarray:
        """``[S][S]`` seconds per micro-batch to re-shard between neighbours (:meth:`LayerCosts.redistribution`)."""
        return self._layers.redistribution(type_index, candidates, micro_batch)

    def switch_penalties(self, type_index: int, candidates: Sequence[Candidate]) -> np.ndarray:
        """``[S][S]`` tie-breaker seconds between neighbours (:meth:`LayerCosts.switch_penalties`)."""
        return self._layers.switch_penalties(type_index, candidates)

    # ----------------------------------------------------------------------------------------------- vocabulary
    def vocab_options(
        self, pp: int, max_tp: int, *, allow_sp: bool, allow_zero3: bool, allow_tp: bool = True, max_cp: int = 1
    ) -> list[VocabOption]:
        """Every vocabulary plan whose profile entries exist, for pipeline degree ``pp``
        (:meth:`VocabCosts.options`)."""
        return self._vocab.options(
            pp, max_tp, allow_sp=allow_sp, allow_zero3=allow_zero3, allow_tp=allow_tp, max_cp=max_cp
        )

    def vocab_terms(
        self, pp: int, option: VocabOption, micro_batch: int, num_micro_batches: int, in_flight: Sequence[float]
    ) -> list[VocabTerms]:
        """Vocabulary costs per stage, ``pp`` entries (:meth:`VocabCosts.terms`)."""
        return self._vocab.terms(pp, option, micro_batch, num_micro_batches, in_flight)

    def vocab_boundaries(
        self, option: VocabOption, candidates: Sequence[Candidate], micro_batch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Seconds per micro-batch to re-shard into the first layer and out of the last layer
        (:meth:`VocabCosts.boundaries`)."""
        return self._vocab.boundaries(option, candidates, micro_batch)

    def optimizer_s(self, states_mib: float) -> float:
        """Seconds of the optimizer step of a rank holding ``states_mib`` of model states: the parameters those
        states stand for (the accounting's bytes per parameter) at the profile's measured AdamW rate."""
        # states_mib is priced: a calibration's states factor scales its bytes, not the parameters the step updates
        parameters = states_mib / self.settings.factors.states * 2**20 / sum(self.settings.state_bytes)
        rate_ms = self.hardware.optimizer_ms_per_million_parameters
        return parameters / 1e6 * rate_ms * 1e-3 * self.settings.factors.compute

    def optimizer_call_s(self) -> float:
        """Seconds of the optimizer step every rank pays once whatever it holds (the model profile's measured
        ``optimizer_call_ms``, 0 without it), scaled as compute, and there the step's two world all-reduces of a few
        fp64 numbers (the all-reduce curve's smallest size, 1-4 ms on gloo CPU): the loss's totals, right after the
        gradients' reduction (idle), and the clip's squared norm, after the norms' compute (busy); each layer's share
        is ``LayerTerms.step_s``."""
        if self.model.optimizer_call_ms is None:
            return 0.0
        own = self.model.optimizer_call_ms * 1e-3 * self.settings.factors.compute * self._compute_scale
        world = self.world_size
        calls = self.comm.allreduce_latency(world, busy=False) + self.comm.allreduce_latency(world)
        return own + calls * self.settings.factors.dp_comm

    # ----------------------------------------------------------------------------------------------- pipeline
    def in_flight(
        self, pp: int, num_micro_batches: int, schedule: PipelineSchedule | None = None, virtual_stages: int = 1
    ) -> list[float]:
        """Activations each stage holds at its peak, in micro-batches of the whole stage
        (:func:`galva_search.pipeline_costs.in_flight`); ``schedule`` defaults to the settings' schedule."""
        schedule = self.settings.pipeline_schedule if schedule is None else schedule
        return in_flight(pp, num_micro_batches, schedule, virtual_stages)

    def split_backward_overhead_s(self, type_index: int) -> float:
        """Seconds one layer of type ``type_index`` adds to a micro-batch when zb-h1 splits its backward (the model
        profile's ``split_backward_overhead_ms``, scaled as compute: the job's concurrency and the calibration)."""
        ms = self.model.layer_types[type_index].split_backward_overhead_ms
        return ms * 1e-3 * self.settings.factors.compute * self._compute_scale

    def shared_processors(self, pp: int) -> SharedProcessors | None:
        """How a plan of ``pp`` stages shares the nodes' processors, or None where every rank has its own
        (the hardware profile's ``processors_per_node``; :func:`shared_pipeline_time`)."""
        if not self.hardware.shares_processors:
            return None
        cluster = self.hardware.cluster
        return SharedProcessors(
            self.hardware.compute_slowdown, cluster.gpus_per_node, cluster.world_size // pp,
            self.hardware.processors_per_node,
        )  # fmt: skip
