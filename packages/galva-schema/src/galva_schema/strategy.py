"""The per-layer hybrid-parallel plan: written by galva-search (or by hand), read by galva-hp.

A :class:`Strategy` fixes, for a world of ``world_size`` ranks, the pipeline degree and partition, the schedule,
micro-batching and precision, and per transformer layer the tensor-parallel (or Ulysses) degree and group layout,
the data-parallel type and activation checkpointing. The vocabulary layers (embedding, final norm, head) have
their own small plan. Everything that can be derived (data-parallel degree per layer, stage of each layer) is a
property, never a stored field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, model_validator

from galva_schema._base import GalvaFile, GalvaModel
from galva_schema.errors import group_problems
from galva_schema.sharding import sequence_shards
from galva_schema.vocabulary import DataParallelType, PipelineSchedule, Precision

MAX_BATCH_SIZE = 2**31 - 1
"""Upper bound of ``global_batch_size`` and ``num_micro_batches`` (samples and micro-batches per optimizer step).

No real job comes near it: the largest published runs take a few thousand sequences per step, about 10**6 times
less. A larger value is a typo or an overflow upstream, and it would be taken silently otherwise (a search that
spins over its divisors for minutes, a plan that crashes the runtime). It is the largest signed 32-bit integer: a
count below it fits whatever integer type a library holds it in.
"""


class LayerStrategy(GalvaModel):
    """How one transformer layer is parallelised inside its pipeline stage."""

    tp: PositiveInt = Field(1, description="Tensor-parallel degree; the Ulysses degree when `ulysses` is true.")
    tp_consecutive: bool = Field(
        True, description="Tensor-parallel group of consecutive ranks (true) or ranks strided by W/pp/tp (false)."
    )
    ulysses: bool = Field(False, description="Ulysses sequence parallel (all-to-all) instead of Megatron tp.")
    cp: PositiveInt = Field(
        1,
        description="Context-parallel degree: ring attention over this many groups of the layer's model-parallel "
        "ranks, each holding two chunks of the sequence (galva_schema.sharding); data parallelism gets the rest.",
    )
    dp_type: DataParallelType | None = Field(
        None, description="Data-parallel type of this layer; null means the strategy's `default_dp_type`."
    )
    checkpoint: bool = Field(False, description="Recompute this layer's activations in backward.")
    ep: PositiveInt = Field(
        1, description="Expert-parallel degree: the layer's experts split over ep ranks (mixture-of-experts layers)."
    )
    etp: PositiveInt = Field(1, description="Expert tensor-parallel degree: each expert's FFN split over etp ranks.")
    expert_dp_type: DataParallelType | None = Field(
        None, description="Data-parallel type of the expert replicas; null means the layer's own dp type."
    )

    @property
    def tp_degree(self) -> int:
        """Megatron tensor-parallel degree (1 for Ulysses layers)."""
        return 1 if self.ulysses else self.tp

    @property
    def sp_degree(self) -> int:
        """Ulysses sequence-parallel degree (1 for Megatron layers)."""
        return self.tp if self.ulysses else 1


class VocabStrategy(GalvaModel):
    """Plan of the vocabulary layers: embedding, final norm and head (with the loss)."""

    tp: PositiveInt = Field(1, description="Vocabulary tensor-parallel degree; the sequence-parallel degree if `sp`.")
    sp: bool = Field(False, description="Split the sequence (Ulysses-style) instead of the vocabulary.")
    cp: PositiveInt = Field(1, description="Context-parallel degree: each rank holds its two chunks of the sequence.")
    dp_type: DataParallelType | None = Field(
        None, description="Data-parallel type of the vocabulary layers; null means `default_dp_type`."
    )


class Strategy(GalvaFile):
    """A complete hybrid-parallel plan. See the module docstring."""

    kind: Literal["galva.strategy"] = "galva.strategy"
    world_size: PositiveInt = Field(description="Number of ranks (GPUs or CPU processes).")
    pp: PositiveInt = Field(1, description="Pipeline-parallel degree.")
    pp_division: tuple[PositiveInt, ...] = Field(
        description=(
            "Transformer layers per model chunk, in model order: one chunk per stage (pp entries), or pp x "
            "virtual_stages entries for an interleaved schedule, chunk c running on stage c % pp. Defaults to an "
            "even split, remainder on the last chunk."
        )
    )
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    virtual_stages: PositiveInt = Field(
        1, description="Model chunks per pipeline stage (interleaved-1f1b: 2 or more; every other schedule: 1)."
    )
    num_micro_batches: PositiveInt = Field(
        1, le=MAX_BATCH_SIZE, description="Micro-batches per iteration (gradient accumulation)."
    )
    global_batch_size: PositiveInt = Field(
        le=MAX_BATCH_SIZE, description="Samples per optimizer step over the whole world."
    )
    mixed_precision: Precision = Precision.BF16
    default_dp_type: DataParallelType = DataParallelType.DDP
    megatron_sp: bool = Field(
        False, description="Megatron sequence parallelism: activations between tp layers sharded along the sequence."
    )
    layers: tuple[LayerStrategy, ...] = Field(min_length=1, description="One entry per transformer layer.")
    vocab: VocabStrategy = VocabStrategy()
    description: str | None = Field(None, description="Free text: who wrote this plan and why.")

    @model_validator(mode="before")
    @classmethod
    def _default_division(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("pp_division") is None:
            layers, pp, v = data.get("layers"), data.get("pp", 1), data.get("virtual_stages", 1)
            if isinstance(layers, (list, tuple)) and isinstance(pp, int) and isinstance(v, int) and pp > 0 and v > 0:
                data = {**data, "pp_division": even_division(len(layers), pp * v)}
        return data

    @model_validator(mode="after")
    def _check_runnable(self) -> Strategy:
        problems = list(self._problems())
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _problems(self) -> list[str]:
        out: list[str] = []
        if self.world_size % self.pp:
            return [f"pp: {self.pp} does not divide world_size {self.world_size}"]
        out.extend(self._schedule_problems())
        if len(self.pp_division) != self.num_chunks:
            expected = f"pp is {self.pp}" if self.virtual_stages == 1 else (
                f"pp x virtual_stages is {self.pp} x {self.virtual_stages} = {self.num_chunks}"
            )
            unit = "stages" if self.virtual_stages == 1 else "chunks"
            out.append(f"pp_division: has {len(self.pp_division)} {unit} but {expected}")
        elif sum(self.pp_division) != len(self.layers):
            out.append(
                f"pp_division: sums to {sum(self.pp_division)} layers but the strategy has {len(self.layers)} layers"
            )
        if self.global_batch_size % self.num_micro_batches:
            out.append(
                f"global_batch_size: {self.global_batch_size} is not divisible by "
                f"num_micro_batches {self.num_micro_batches}"
            )
        rps = self.ranks_per_stage
        micro = self.global_batch_size // self.num_micro_batches
        layer_problems: list[tuple[str, int | None, str, str]] = []
        for index, layer in enumerate(self.layers):
            problem = _degree_problem(layer.tp, rps, "tp") or _model_problem(layer.tp, layer.cp, rps)
            if problem is None and layer.ulysses and layer.tp == 1:
                problem = ".ulysses", "needs tp > 1 (tp is the Ulysses degree)"
            if problem is None and rps % (layer.ep * layer.etp):
                problem = ".ep", (
                    f"ep x etp = {layer.ep} x {layer.etp} does not divide the {rps} ranks of a pipeline stage "
                    f"(ep x etp x expert dp must equal them)"
                )
            if problem is None and not out and micro % self.layer_dp(index):
                problem = _batch_problem(micro, self.layer_dp(index))
            if problem:
                layer_problems.append(("layers", index, *problem))
        out.extend(group_problems(layer_problems))
        vocab_problem = _degree_problem(self.vocab.tp, rps, "tp") or _model_problem(self.vocab.tp, self.vocab.cp, rps)
        if vocab_problem is None and self.vocab.sp and self.vocab.tp == 1:
            vocab_problem = ".sp", "needs tp > 1 (tp is the vocabulary sequence-parallel degree)"
        if vocab_problem is None and not out and micro % self.vocab_dp:
            vocab_problem = _batch_problem(micro, self.vocab_dp)
        if vocab_problem:
            out.append(f"vocab{vocab_problem[0]}: {vocab_problem[1]}")
        return out

    def _schedule_problems(self) -> list[str]:
        schedule, v = self.pipeline_schedule, self.virtual_stages
        if schedule is PipelineSchedule.INTERLEAVED_1F1B:
            if self.pp == 1:
                return ["pipeline_schedule: interleaved-1f1b needs pp > 1"]
            if v < 2:
                return ["virtual_stages: interleaved-1f1b needs 2 or more model chunks per stage (with 1 it is 1f1b)"]
            if self.num_micro_batches % self.pp:
                return [
                    f"num_micro_batches: interleaved-1f1b needs a multiple of pp {self.pp}, "
                    f"got {self.num_micro_batches}"
                ]
        elif v != 1:
            return [f"virtual_stages: {v} model chunks per stage need pipeline_schedule interleaved-1f1b, not "
                    f"{schedule.value}"]
        return []

    # ----------------------------------------------------------------------------------------------- derived values
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def ranks_per_stage(self) -> int:
        """Ranks in one pipeline stage, ``world_size // pp``."""
        return self.world_size // self.pp

    @property
    def micro_batch_size(self) -> int:
        """Samples in one micro-batch over the whole world (``global_batch_size // num_micro_batches``)."""
        return self.global_batch_size // self.num_micro_batches

    @property
    def num_chunks(self) -> int:
        """Model chunks over the whole pipeline, ``pp * virtual_stages`` (one per stage unless interleaved)."""
        return self.pp * self.virtual_stages

    def chunk_stage(self, chunk: int) -> int:
        """Pipeline stage that runs model chunk ``chunk``: the one place that maps chunks onto stages."""
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk {chunk} out of range for {self.num_chunks} chunks")
        return chunk % self.pp

    def stage_chunks(self, stage: int) -> tuple[int, ...]:
        """Model chunks run by ``stage``, in model order."""
        if not 0 <= stage < self.pp:
            raise IndexError(f"stage {stage} out of range for pp={self.pp}")
        return tuple(c for c in range(self.num_chunks) if self.chunk_stage(c) == stage)

    def chunk_layers(self, chunk: int) -> range:
        """Indices of the layers in model chunk ``chunk`` (a contiguous run)."""
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk {chunk} out of range for {self.num_chunks} chunks")
        start = sum(self.pp_division[:chunk])
        return range(start, start + self.pp_division[chunk])

    @property
    def layer_chunks(self) -> tuple[int, ...]:
        """Model chunk of each layer."""
        return tuple(chunk for chunk, count in enumerate(self.pp_division) for _ in range(count))

    @property
    def layer_stages(self) -> tuple[int, ...]:
        """Pipeline stage of each layer."""
        return tuple(self.chunk_stage(chunk) for chunk in self.layer_chunks)

    def stage_layers(self, stage: int) -> tuple[int, ...]:
        """Indices of the layers held by ``stage``, in model order (several runs when interleaved)."""
        return tuple(index for chunk in self.stage_chunks(stage) for index in self.chunk_layers(chunk))

    def layer_dp(self, index: int) -> int:
        """Data-parallel degree of layer ``index`` (batch split); Ulysses layers shard states over dp * sp, and
        every layer over dp * cp."""
        layer = self.layers[index]
        return self.ranks_per_stage // (layer.tp * layer.cp)

    def layer_dp_type(self, index: int) -> DataParallelType:
        """Effective data-parallel type of layer ``index``."""
        return self.layers[index].dp_type or self.default_dp_type

    def layer_expert_dp(self, index: int) -> int:
        """Replicas of each expert shard of layer ``index``: ``ranks_per_stage / (ep * etp)``."""
        layer = self.layers[index]
        return self.ranks_per_stage // (layer.ep * layer.etp)

    def layer_expert_dp_type(self, index: int) -> DataParallelType:
        """Effective data-parallel type of layer ``index``'s expert replicas."""
        return self.layers[index].expert_dp_type or self.layer_dp_type(index)

    def layer_sequence_shards(self, index: int) -> int:
        """Sequence slices at layer ``index``'s boundaries (see :func:`galva_schema.sharding.sequence_shards`)."""
        layer = self.layers[index]
        return sequence_shards(layer.tp, ulysses=layer.ulysses, megatron_sp=self.megatron_sp)

    @property
    def vocab_sequence_shards(self) -> int:
        """Sequence slices at the vocabulary layers' boundaries."""
        return sequence_shards(self.vocab.tp, ulysses=self.vocab.sp, megatron_sp=self.megatron_sp)

    @property
    def vocab_dp(self) -> int:
        """Data-parallel degree of the vocabulary layers."""
        return self.ranks_per_stage // (self.vocab.tp * self.vocab.cp)

    @property
    def vocab_dp_type(self) -> DataParallelType:
        return self.vocab.dp_type or self.default_dp_type

    def layer_summary(self, index: int) -> str:
        """Compact form ``pp-tp[*]-dp[f|z2]-c-sp`` as in the reference system's logs (``*`` = consecutive tp)."""
        layer = self.layers[index]
        text = f"{self.pp}-{layer.tp}{'*' if layer.tp_consecutive and layer.tp > 1 else ''}-{self.layer_dp(index)}"
        dp_type = self.layer_dp_type(index)
        text += {DataParallelType.DDP: "", DataParallelType.ZERO2: "z2", DataParallelType.ZERO3: "f"}[dp_type]
        if layer.checkpoint:
            text += "-c"
        if layer.ulysses:
            text += "-sp"
        if layer.cp > 1:
            text += f"-cp{layer.cp}"
        return text

    def describe(self) -> str:
        """The plan in one phrase (``pp 2 (1f1b), tp 2, 4 micro-batches, ...``): the one description that galva-train's
        banner, its report and galva run print."""
        tp = sorted({layer.tp for layer in self.layers})
        dp = sorted({(layer.dp_type or self.default_dp_type).value for layer in self.layers})
        pipeline = f"pp {self.pp}"
        if self.pp > 1:
            chunks = f", {self.virtual_stages} model chunks per stage" if self.virtual_stages > 1 else ""
            pipeline += f" ({self.pipeline_schedule.value}{chunks})"
        parts = [
            pipeline,
            f"tp {'/'.join(map(str, tp))}" + (" (Ulysses)" if any(layer.ulysses for layer in self.layers) else ""),
            f"{self.num_micro_batches} micro-batch{'es' if self.num_micro_batches > 1 else ''}",
            f"global batch {self.global_batch_size}",
            "/".join(dp),
            self.mixed_precision.value,
        ]
        cp = sorted({layer.cp for layer in self.layers})
        if cp != [1]:
            parts.insert(2, f"cp {'/'.join(map(str, cp))}")
        if self.megatron_sp:
            parts.append("Megatron-SP")
        ep = sorted({(layer.ep, layer.etp) for layer in self.layers if layer.ep * layer.etp > 1})
        if ep:
            parts.append("experts " + "/".join(f"ep {e}" + (f" x etp {t}" if t > 1 else "") for e, t in ep))
        if any(layer.checkpoint for layer in self.layers):
            parts.append(f"checkpointing {sum(layer.checkpoint for layer in self.layers)} layers")
        return ", ".join(parts)

    @classmethod
    def uniform(
        cls,
        *,
        world_size: int,
        num_layers: int,
        global_batch_size: int,
        layer: LayerStrategy | dict[str, Any] | None = None,
        **fields: Any,
    ) -> Strategy:
        """One strategy for every layer (the reference system's "global mode")."""
        return cls.model_validate(
            {
                "world_size": world_size,
                "global_batch_size": global_batch_size,
                "layers": [LayerStrategy.model_validate(layer or {}).model_dump()] * num_layers,
                **fields,
            }
        )


def even_division(num_layers: int, pp: int) -> list[int]:
    """Layers per chunk for an even split into ``pp`` chunks, the remainder on the last (the reference default)."""
    if pp <= 0 or num_layers < pp:
        return [1] * pp  # invalid; validation reports the mismatch with a clear message
    base = num_layers // pp
    return [base] * (pp - 1) + [num_layers - base * (pp - 1)]


def _degree_problem(degree: int, ranks_per_stage: int, name: str) -> tuple[str, str] | None:
    if degree > ranks_per_stage:
        return f".{name}", f"{degree} is larger than the {ranks_per_stage} ranks of a pipeline stage"
    if ranks_per_stage % degree:
        return f".{name}", f"{degree} does not divide the {ranks_per_stage} ranks of a pipeline stage"
    return None


def _model_problem(degree: int, cp: int, ranks_per_stage: int) -> tuple[str, str] | None:
    """The context-parallel degree against what the model-parallel ``degree`` leaves of a stage."""
    problem = _degree_problem(cp, ranks_per_stage, "cp")
    if problem is None and ranks_per_stage % (degree * cp):
        verb = "is more than" if degree * cp > ranks_per_stage else "does not divide"
        return ".cp", f"tp {degree} x cp {cp} {verb} the {ranks_per_stage} ranks of a pipeline stage"
    return problem


def _batch_problem(micro: int, dp: int) -> tuple[str, str]:
    return "", (
        f"a micro-batch of {micro} samples cannot be split over data-parallel degree {dp} "
        f"(global_batch_size / num_micro_batches must be a multiple of it)"
    )
