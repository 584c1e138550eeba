"""What the model can run, as the search needs it: asked of :func:`galva_schema.plan_problems`, never guessed.

A model profile may carry :class:`galva_schema.ModelConstraints` (heads, unsupported forms, sequence lengths, shared
parameters). The search then plans nothing the runtime would refuse:

* a candidate is allowed for a layer type when ``plan_problems`` finds nothing wrong with a one-layer probe plan
  that runs it (memoised per layer type and form: degree, Ulysses, ZeRO-3, end of the type or not, because a type's
  last layer must also split its output sequence);
* a vocabulary option is allowed when a probe plan with that vocabulary passes;
* shared parameters restrict nothing: galva-hp gives every rank that runs a reader a copy and sums the gradient over
  them (galva_hp.shared_params), so partitions may cut their layers and the layers may use different tp layouts;
* the chosen plan is checked whole with ``plan_problems``; a problem there is a bug of the search.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from galva_schema import (
    DataParallelType,
    LayerStrategy,
    ModelConstraints,
    ModelProfile,
    SchemaError,
    Strategy,
    VocabStrategy,
    plan_problems,
)
from galva_search.cost_model import CostSettings, VocabOption
from galva_search.space import Candidate


class ModelRules:
    """The model's constraints for one search (every question answers "allowed" when the profile has none)."""

    def __init__(
        self, model: ModelProfile, settings: CostSettings, world_size: int, *, source: str | None = None
    ) -> None:
        self.constraints: ModelConstraints | None = model.constraints
        self.settings = settings
        self.world_size = world_size
        self.source = source
        self.seq_lengths = [lt.seq_length for lt in model.layer_types]
        self._layer: dict[tuple[int, int, bool, bool, bool, int, int, int], bool] = {}
        if self.constraints is not None:
            self._check_any_plan_runs()

    @property
    def run_seq_length(self) -> int:
        """The run's sequence length, as ``plan_problems`` takes it: the first layer type's profiled sequence (a layer
        type whose tokens differ states them in its constraints' ``seq_length``)."""
        return self.seq_lengths[0]

    # ------------------------------------------------------------------------------------------------ layers
    def allowed(self, type_index: int, candidates: Sequence[Candidate], type_end: bool) -> np.ndarray:
        """Per candidate, whether a layer of type ``type_index`` may run it (``type_end``: the type's last layer)."""
        if self.constraints is None:
            return np.ones(len(candidates), dtype=bool)
        return np.array([self._layer_allows(type_index, c, type_end) for c in candidates], dtype=bool)

    def _layer_allows(self, type_index: int, c: Candidate, type_end: bool) -> bool:
        zero3 = c.dp_type is DataParallelType.ZERO3
        key = (type_index, c.tp, c.ulysses, zero3, type_end, c.ep, c.etp, c.cp)
        hit = self._layer.get(key)
        if hit is None:
            assert self.constraints is not None
            own = self.constraints.layer_types[type_index]
            one = own.model_copy(
                update={"num_layers": 1, "output_seq_length": own.output_seq_length if type_end else None}
            )
            probe_constraints = ModelConstraints(model_name=self.constraints.model_name, layer_types=(one,))
            layer = LayerStrategy(
                tp=c.tp, ulysses=c.ulysses, dp_type=DataParallelType.ZERO3 if zero3 else None, ep=c.ep, etp=c.etp,
                cp=c.cp,
            )
            probe = self._probe(layer, VocabStrategy(), ranks=max(2 * c.tp * c.cp, c.ep * c.etp))
            problems = plan_problems(probe, probe_constraints, seq_len=self.run_seq_length)  # as check() asks
            hit = self._layer[key] = not problems
        return hit

    # ------------------------------------------------------------------------------------------------ vocabulary
    def vocab_allows(self, option: VocabOption) -> bool:
        """Whether the vocabulary layers may run ``option``."""
        if self.constraints is None:
            return True
        first = self.constraints.layer_types[0].model_copy(update={"num_layers": 1, "unsupported": {}})
        probe_constraints = ModelConstraints(
            model_name=self.constraints.model_name,
            layer_types=(first,),
            vocab_unsupported=self.constraints.vocab_unsupported,
        )
        zero3 = DataParallelType.ZERO3 if option.zero3 else None
        probe = self._probe(
            LayerStrategy(),
            VocabStrategy(tp=option.tp, sp=option.sp, dp_type=zero3, cp=option.cp),
            ranks=2 * option.tp * option.cp,
        )
        return not plan_problems(probe, probe_constraints, seq_len=self.run_seq_length)

    # ------------------------------------------------------------------------------------------------ checks
    def check(self, strategy: Strategy) -> None:
        """Raise when the chosen plan has a problem: the search must never produce one."""
        if self.constraints is None:
            return
        problems = plan_problems(strategy, self.constraints, world_size=self.world_size, seq_len=self.run_seq_length)
        if problems:
            raise RuntimeError(
                "galva-search chose a plan the model cannot run (a bug in the search): " + "; ".join(problems)
            )

    def _check_any_plan_runs(self) -> None:
        """Problems of the plainest plan (every layer tp 1, the default dp type) are problems of every plan."""
        assert self.constraints is not None
        probe = Strategy.uniform(
            world_size=self.world_size,
            num_layers=self.constraints.num_layers,
            global_batch_size=self.world_size,
            mixed_precision=self.settings.precision,
            default_dp_type=self.settings.default_dp_type,
            megatron_sp=self.settings.megatron_sp,
        )
        problems = plan_problems(probe, self.constraints, world_size=self.world_size, seq_len=self.run_seq_length)
        if problems:
            raise SchemaError("constraints: no plan can run this model: " + "; ".join(problems), source=self.source)

    def _probe(self, layer: LayerStrategy, vocab: VocabStrategy, ranks: int) -> Strategy:
        """A one-stage, one-layer plan on ``ranks`` ranks, one sample per rank, with the search's settings."""
        return Strategy.uniform(
            world_size=ranks,
            num_layers=1,
            global_batch_size=ranks,
            layer=layer,
            vocab=vocab,
            mixed_precision=self.settings.precision,
            default_dp_type=self.settings.default_dp_type,
            megatron_sp=self.settings.megatron_sp,
        )
