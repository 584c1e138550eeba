"""Measured per-layer cost of a model (written by galva-profiler, read by galva-search).

Times are forward-pass milliseconds on one device without any parallelism; backward is modelled by the search.
Memory is MiB. Activation entries are *per local sample* on a rank running the given tensor-parallel degree.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

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


class ExpertProfile(GalvaModel):
    """The routed experts of a mixture-of-experts layer type, measured apart from the rest of the layer.

    The layer's own fields describe the whole layer with every expert on one rank (ep 1): ``parameter_mib``
    includes ``expert_parameter_mib`` and ``block_parameter_mib``, ``forward_time`` includes the experts' compute,
    ``activation_mib_per_sample`` includes what the experts keep. These fields let the search price the experts
    under their own layout (ep, etp, expert dp).
    """

    num_experts: PositiveInt = Field(description="Routed experts of one layer.")
    top_k: PositiveInt = Field(description="Experts each token is routed to.")
    expert_ffn: PositiveInt = Field(description="Each routed expert's FFN (intermediate) size.")
    expert_parameter_mib: NonNegativeFloat = Field(
        description="Parameters of all routed experts of one layer, fp32 bytes, MiB (split over ep x etp ranks)."
    )
    block_parameter_mib: NonNegativeFloat = Field(
        0.0,
        description="Parameters of the experts' block outside the routed experts (router, shared experts), fp32 "
        "bytes, MiB: replicated over tp (the block sees distinct tokens on every rank).",
    )
    expert_time: BatchTime = Field(
        description="Forward ms of ONE expert's FFN on n routed rows (the batch is rows, not samples)."
    )
    router_ms_per_token: NonNegativeFloat = Field(description="Forward ms of the router per token.")
    imbalance: dict[PositiveInt, float] = Field(
        description="Measured load imbalance by ep degree: the largest rank's routed rows in one layer over the "
        "mean, with the experts split in contiguous runs over ep ranks, from real routing of random tokens through "
        "the profiled model, the mean over the type's layers (ep 1: 1.0): what a layer's compute and dispatch "
        "wait for."
    )
    activation_mib_per_row: NonNegativeFloat = Field(
        description="Activation memory the experts keep per routed row (one token sent to one expert), MiB; part "
        "of activation_mib_per_sample."
    )
    dispatch_activation_mib_per_row: NonNegativeFloat = Field(
        0.0,
        description="What dispatch and combine keep beyond that per routed row under ep > 1 (received rows and "
        "their weights), MiB.",
    )
    memory_imbalance: dict[PositiveInt, list[float]] = Field(
        default_factory=dict,
        description="By ep degree, per profiled forward: the largest rank's routed rows summed over ALL the type's "
        "layers over the mean (what a rank keeps for backward: its busiest layers differ, so below imbalance); "
        "empty: imbalance.",
    )
    routed_tokens: NonNegativeInt = Field(
        0, description="Tokens routed in each profiled forward (the pool memory_imbalance was measured on)."
    )

    @model_validator(mode="after")
    def _check(self) -> ExpertProfile:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        summed = (x for figures in self.memory_imbalance.values() for x in figures)
        if any(v < 1.0 for v in (*self.imbalance.values(), *summed)):
            raise ValueError("imbalance, memory_imbalance: every value is max/mean, so at least 1.0")
        return self


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
    window: PositiveInt | None = Field(
        None,
        description="The sliding window of this type's windowed layers: a query attends to keys fewer than "
        "`window` positions before it (and after it, bidirectional); None: every layer attends over the whole "
        "sequence. The fit above is timed without it; a ring rank skips the blocks outside it.",
    )
    window_layers: NonNegativeInt = Field(
        0, description="How many of this type's layers attend within `window` (the others: the whole sequence)."
    )


OverheadForm = Literal["tp", "megatron_sp", "ulysses"]  # the parallel forms whose overhead a profile times
ShardedForm = Literal["zero2", "zero3"]  # the data-parallel types whose overhead a profile times (FSDP2 units)


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
    weight_grad_share: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Share of the layer's backward time that is weight gradients (what zb-h1 defers into the "
        "pipeline bubble), measured as 1 - input-gradient-only / whole backward. None: not profiled (taken as 1/2).",
    )
    experts: ExpertProfile | None = Field(
        None, description="The routed experts of a mixture-of-experts layer type; null for a dense layer type."
    )
    attention_core: AttentionCoreProfile | None = Field(
        None,
        description="The attention core apart from the linear parts (context parallelism's ring steps). None: "
        "the search takes the quadratic term of a sequence forward_time as the core (none otherwise) and "
        "2 x hidden_size x element bytes per token.",
    )

    parallel_overhead_ms: dict[OverheadForm, dict[PositiveInt, tuple[NonNegativeFloat, NonNegativeFloat]]] = Field(
        default_factory=dict,
        description="(forward, backward) ms one call of the layer's parallel form costs beyond the plain layer on "
        "the same work per rank (F(b/degree)), by form ('tp' Megatron, 'megatron_sp', 'ulysses') and degree: the "
        "parallel linears' extra Python, copies and splits, measured in the main thread's CPU time on forked gloo "
        "ranks, collectives left out (they are priced from the hardware profile). Empty: not profiled (0).",
    )
    sharded_overhead_ms: dict[
        ShardedForm, dict[PositiveInt, tuple[NonNegativeFloat, NonNegativeFloat, NonNegativeFloat]]
    ] = Field(
        default_factory=dict,
        description="(forward, backward, optimizer step) ms one layer under ZeRO costs beyond the plain layer on the "
        "same work per rank, by dp type ('zero2', 'zero3') and sharding degree: FSDP2's hooks and the copies around "
        "its all-gathers and reduce-scatter (forward and backward: per micro-batch, the backward with gradient sync "
        "on, as in the iteration's last micro-batch), and AdamW "
        "stepping the layer's sharded (DTensor) parameters beyond plain tensors of the same shards (once per "
        "iteration). Main thread's CPU time on forked gloo ranks, collectives left out (priced from the hardware "
        "profile). Empty: not profiled (0).",
    )
    sharded_accumulate_ms: dict[ShardedForm, dict[PositiveInt, NonNegativeFloat]] = Field(
        default_factory=dict,
        description="Backward ms one layer under ZeRO costs beyond the plain layer in a micro-batch before the "
        "iteration's last, by dp type and sharding degree: gradient sync off, FSDP2 only accumulates the unsharded "
        "gradients (no copies around a reduce-scatter); the sync-on backward of sharded_overhead_ms is the last "
        "micro-batch's. Measured as sharded_overhead_ms. Empty: not profiled (every micro-batch priced as the last).",
    )
    split_backward_overhead_ms: NonNegativeFloat = Field(
        0.0,
        description="ms one call of the layer's backward costs more when zb-h1 splits it (input gradients, then "
        "weight gradients, as galva-hp runs the two) than as one autograd call, at the largest profiled batch: the "
        "split's graph analysis and one autograd call per parameter group. 0: not profiled.",
    )
    backward_time: ForwardTime | None = Field(
        None,
        description="Backward time of ONE layer (ms) as a function of batch, measured beside forward_time (the "
        "backward of the layer's output seeded with ones). None: not profiled (the search takes "
        "--backward-coefficient times forward_time).",
    )
    optimizer_step_ms: tuple[NonNegativeFloat, NonNegativeFloat] | None = Field(
        None,
        description="(ms per layer, ms per million parameters) ONE layer adds to galva-hp's optimizer step (the "
        "gradient norm, clipping and AdamW, as the runtime runs them), timed on copies of the layer's own tensors: "
        "the first is the per-tensor work that does not shrink when a rank holds shards, the second the work per "
        "element. None: not profiled (the hardware profile's rate per parameter).",
    )

    @model_validator(mode="after")
    def _check(self) -> LayerTypeProfile:
        if 1 not in self.activation_mib_per_sample:
            raise ValueError(f"activation_mib_per_sample: layer type {self.name!r} needs an entry for tp 1")
        core = self.attention_core
        if core is not None and core.window_layers > self.num_layers:
            raise ValueError(
                f"attention_core.window_layers: {core.window_layers} windowed layers, but layer type {self.name!r} "
                f"has {self.num_layers}"
            )
        if core is not None and core.window_layers and core.window is None:
            raise ValueError(f"attention_core.window: layer type {self.name!r} has windowed layers but no window")
        return self


class VocabMemory(GalvaModel):
    """Memory of the vocabulary layers at one pipeline position, by vocabulary tp degree."""

    model_states_mib: dict[PositiveInt, NonNegativeFloat] = Field(
        description="Parameters + gradients + optimizer states held per rank, MiB, by vocab tp degree (unsharded dp)."
    )
    activation_mib_per_sample: dict[PositiveInt, NonNegativeFloat] = Field(
        description="Activation memory per local sample, MiB, by vocab tp degree."
    )


CallOp = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]


class CollectiveCall(GalvaModel):
    """One torch.distributed collective a vocabulary form makes per micro-batch (recorded on the profiler's ranks)."""

    op: CallOp = Field(
        description="all_reduce, all_gather (bytes: its output), reduce_scatter (bytes: its input) or all_to_all; "
        "a broadcast or any other call is recorded as an all-reduce of its buffer."
    )
    backward: bool = Field(description="Made in the backward pass (else in the forward).")
    bytes_per_sample: NonNegativeFloat = Field(description="Buffer bytes per local sample the form reads.")
    bytes_fixed: NonNegativeFloat = Field(0.0, description="Buffer bytes whatever the batch (parameters, counts).")

    def nbytes(self, samples: float) -> float:
        """The buffer at ``samples`` local samples."""
        return self.bytes_per_sample * samples + self.bytes_fixed


class VocabPart(GalvaModel):
    """One vocabulary module (the embedding, or the final norm with the head and loss) in one parallel form."""

    overhead_ms: tuple[NonNegativeFloat, NonNegativeFloat, NonNegativeFloat] = Field(
        description="(forward, backward, optimizer step) ms of the calling thread beyond the plain module on the same "
        "work per rank, the CPU spent inside torch.distributed's calls left out (their time is priced per call)."
    )
    calls: tuple[CollectiveCall, ...] = Field((), description="Its collectives per micro-batch, in call order.")


class VocabForm(GalvaModel):
    """What a parallel form of the vocabulary layers does beyond the plain modules, measured on forked ranks."""

    embedding: VocabPart
    head: VocabPart

    def part(self, name: Literal["embedding", "head"]) -> VocabPart:
        return self.embedding if name == "embedding" else self.head


VocabFormName = Literal["tp", "zero3"]  # vocabulary tp (at the profile's megatron_sp), ZeRO-3 units (FSDP2)


class VocabProfile(GalvaModel):
    """Embedding, final norm, head and loss."""

    vocab_size: PositiveInt | None = None
    forward_time: ForwardTime = Field(description="Forward time of all vocabulary layers together (ms).")
    memory_pp_off: VocabMemory = Field(description="All vocabulary layers on one stage (pp = 1).")
    memory_pp_first: VocabMemory = Field(description="First stage of a pipeline (embedding).")
    memory_pp_last: VocabMemory = Field(description="Last stage of a pipeline (norm, head, loss).")
    backward_time: ForwardTime | None = Field(
        None,
        description="Backward time of all vocabulary layers together (ms), measured beside forward_time. None: "
        "not profiled (--backward-coefficient times forward_time).",
    )
    optimizer_step_ms: tuple[NonNegativeFloat, NonNegativeFloat] | None = Field(
        None,
        description="(ms, ms per million parameters) all vocabulary layers together add to galva-hp's optimizer "
        "step (as LayerTypeProfile.optimizer_step_ms); a pipeline stage holding half of them pays half the first. "
        "None: not profiled (the hardware profile's rate per parameter).",
    )
    forms: dict[VocabFormName, dict[PositiveInt, VocabForm]] = Field(
        default_factory=dict,
        description="By form and degree (tp: the vocabulary tp degree, at the profile's megatron_sp; zero3: the "
        "sharding group's size), what the form's embedding and head cost beyond the plain modules and the "
        "collectives they call. Empty: not profiled (a tp form's two all-reduces and ZeRO-3's one gather per "
        "stage priced from the parameters, no overhead).",
    )


class ModelProfile(GalvaFile):
    """Compute and memory profile of one model at given sequence lengths."""

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
    optimizer_call_ms: NonNegativeFloat | None = Field(
        None,
        description="ms of galva-hp's optimizer step that every rank pays once per iteration whatever it holds (the "
        "optimizer's and the learning-rate schedule's own per-call work), beside what each layer adds "
        "(LayerTypeProfile.optimizer_step_ms). None: not profiled (0).",
    )
    compute_reference_ms: PositiveFloat | None = Field(
        None,
        description="ms of one fp32 256 x 256 matmul, the median of samples taken between the layers' timed passes by "
        "their clock: the profile's speed in the minutes it timed the layers. With the hardware profile's own "
        "(HardwareProfile.compute_reference_ms), galva-search prices the layers as if timed in that profile's "
        "minutes. None: not measured (an older profile: the times as they are).",
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
