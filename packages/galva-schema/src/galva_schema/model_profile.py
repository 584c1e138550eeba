"""Measured per-layer cost of a model (written by galva-profiler, read by galva-search).

Times are forward-pass milliseconds on one device without any parallelism; backward is modelled by the search.
Memory is MiB. Activation entries are *per local sample* on a rank running the given tensor-parallel degree.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, NonNegativeFloat, PositiveInt, model_validator

from galva_schema._base import GalvaFile, GalvaModel
from galva_schema.constraints import ModelConstraints
from galva_schema.vocabulary import Precision


class StaticTime(GalvaModel):
    """One measurement: forward ms per sample, valid at the profiled batch size and sequence length."""

    form: Literal["static"] = "static"
    ms_per_sample: NonNegativeFloat
    batch_size: PositiveInt | None = Field(None, description="Batch size the value was measured at, if known.")

    def forward_ms(self, batch: float, seq_length: int) -> float:
        return self.ms_per_sample * batch


class BatchTime(GalvaModel):
    """Linear in the local batch: ``forward_ms(b) = slope_ms_per_sample * b + intercept_ms``."""

    form: Literal["batch"] = "batch"
    slope_ms_per_sample: NonNegativeFloat
    intercept_ms: float

    def forward_ms(self, batch: float, seq_length: int) -> float:
        return max(0.0, self.slope_ms_per_sample * batch + self.intercept_ms)


class SequenceTime(GalvaModel):
    """Per sample, quadratic in sequence length: ``(a s^2 + b s + c) * batch`` with ``coefficients = (a, b, c)``."""

    form: Literal["sequence"] = "sequence"
    coefficients: tuple[float, float, float]

    def forward_ms(self, batch: float, seq_length: int) -> float:
        a, b, c = self.coefficients
        return max(0.0, a * seq_length**2 + b * seq_length + c) * batch


ForwardTime = Annotated[Union[StaticTime, BatchTime, SequenceTime], Field(discriminator="form")]


class AttentionCoreProfile(GalvaModel):
    """The attention core of one layer (scores, softmax, weighted values: what ring attention splits into blocks),
    apart from its linear parts: what context parallelism's ring steps are priced by."""

    forward_time: SequenceTime = Field(
        description="Forward ms per sample of the attention core alone against sequence length (tp 1, no mask "
        "beyond the model's own), fitted over the profiled lengths."
    )
    kv_bytes_per_token: PositiveInt = Field(
        description="Key and value bytes one token's block carries around the ring (tp 1, the profile's "
        "precision): 2 x key/value heads x head size x element bytes."
    )
    causal: bool = Field(True, description="Causal (a rank skips the blocks above the diagonal) or bidirectional.")
    seq_lengths: tuple[PositiveInt, ...] = Field((), description="Sequence lengths the fit was measured at.")


class LayerTypeProfile(GalvaModel):
    """One kind of transformer layer (e.g. the decoder layer of a GPT, or the encoder layer of a T5)."""

    name: str = Field(description="For example 'decoder' or 'encoder'.")
    num_layers: PositiveInt = Field(description="Layers of this type in the model.")
    hidden_size: PositiveInt
    seq_length: PositiveInt = Field(description="Sequence length this profile describes.")
    forward_time: ForwardTime = Field(description="Forward time of ONE layer (ms) as a function of batch.")
    parameter_mib: NonNegativeFloat = Field(description="Parameters of one unsharded layer, fp32 bytes, MiB.")
    activation_mib_per_sample: dict[PositiveInt, NonNegativeFloat] = Field(
        description="Activation memory kept for backward, MiB per local sample, by tensor-parallel degree."
    )
    checkpoint_activation_mib_per_sample: NonNegativeFloat = Field(
        description="Activation memory per local sample when the layer is checkpointed (tp 1), MiB."
    )
    megatron_sp_activation_mib_per_sample: dict[PositiveInt, NonNegativeFloat] = Field(
        default_factory=dict,
        description="Activation memory per local sample under Megatron-SP, MiB, by tp degree (the rank's input is "
        "[b, s/tp, h]). Empty: not profiled (the search then uses activation_mib_per_sample).",
    )
    ulysses_activation_mib_per_sample: dict[PositiveInt, NonNegativeFloat] = Field(
        default_factory=dict,
        description="Activation memory per local sample under Ulysses sequence parallelism, MiB, by sp degree "
        "(all-to-all buffers included). Empty: not profiled (the search then uses activation_mib_per_sample[1] / sp).",
    )
    activation_mib_per_call: NonNegativeFloat = Field(
        0.0,
        description="Activation memory one forward call of the layer keeps whatever the batch (e.g. rotary cos/sin "
        "tables; measured on the plain layer), MiB, per micro-batch in flight; not kept by a checkpointed layer.",
    )
    attention_core: AttentionCoreProfile | None = Field(
        None,
        description="The attention core apart from the linear parts (context parallelism's ring steps). None: "
        "the search takes the quadratic term of a sequence forward_time as the core (none otherwise) and "
        "2 x hidden_size x element bytes per token.",
    )

    @model_validator(mode="after")
    def _check(self) -> LayerTypeProfile:
        if 1 not in self.activation_mib_per_sample:
            raise ValueError(f"activation_mib_per_sample: layer type {self.name!r} needs an entry for tp 1")
        return self


class VocabMemory(GalvaModel):
    """Memory of the vocabulary layers at one pipeline position, by vocabulary tp degree."""

    model_states_mib: dict[PositiveInt, NonNegativeFloat] = Field(
        description="Parameters + gradients + optimizer states held per rank, MiB, by vocab tp degree (unsharded dp)."
    )
    activation_mib_per_sample: dict[PositiveInt, NonNegativeFloat] = Field(
        description="Activation memory per local sample, MiB, by vocab tp degree."
    )


class VocabProfile(GalvaModel):
    """Embedding, final norm, head and loss."""

    vocab_size: PositiveInt | None = None
    forward_time: ForwardTime = Field(description="Forward time of all vocabulary layers together (ms).")
    memory_pp_off: VocabMemory = Field(description="All vocabulary layers on one stage (pp = 1).")
    memory_pp_first: VocabMemory = Field(description="First stage of a pipeline (embedding).")
    memory_pp_last: VocabMemory = Field(description="Last stage of a pipeline (norm, head, loss).")


class ModelProfile(GalvaFile):
    """Compute and memory profile of one model at given sequence lengths."""

    KIND: ClassVar[str] = "galva.model_profile"

    schema_version: Literal[1] = 1
    kind: Literal["galva.model_profile"] = "galva.model_profile"
    model_name: str
    precision: Precision = Field(description="Precision the profile was measured in.")
    megatron_sp: bool = Field(False, description="Activations were measured with Megatron sequence parallelism.")
    layer_types: tuple[LayerTypeProfile, ...] = Field(min_length=1)
    vocab: VocabProfile
    constraints: ModelConstraints | None = Field(
        None,
        description="What the model can run (heads, unsupported forms, shared parameters): the planner proposes "
        "nothing else. Null: no model constraints known (only the strategy's own rules apply).",
    )

    @model_validator(mode="after")
    def _check_constraints(self) -> ModelProfile:
        if self.constraints is None:
            return self
        profiled = [(t.name, t.num_layers) for t in self.layer_types]
        declared = [(t.name, t.num_layers) for t in self.constraints.layer_types]
        if profiled != declared:
            raise ValueError(
                f"constraints: layer types (name, count) {declared} differ from the profiled layer types {profiled}"
            )
        return self

    @property
    def num_layers(self) -> int:
        return sum(layer_type.num_layers for layer_type in self.layer_types)

    @property
    def sequence_lengths(self) -> tuple[int, ...]:
        return tuple(layer_type.seq_length for layer_type in self.layer_types)

    def layer_type_of(self, index: int) -> int:
        """Index of the layer type of transformer layer ``index`` (types are contiguous, in model order)."""
        for type_index, layer_type in enumerate(self.layer_types):
            if index < layer_type.num_layers:
                return type_index
            index -= layer_type.num_layers
        raise IndexError(f"layer {index} out of range for a model of {self.num_layers} layers")
