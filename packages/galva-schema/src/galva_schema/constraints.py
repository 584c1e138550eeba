"""What a model can run, as data, and the one function that checks a plan against it.

A model adapter (galva-models, or galva-hp's tiny test models) states its constraints as a :class:`ModelConstraints`:
per layer type the attention head and key/value-head counts, the parallel forms it cannot run (each with the
reason), the token counts a sequence-sharding degree must divide; the layers that share a parameter (which places no
restriction on a plan); the forms the vocabulary layers cannot run; the longest sequence. The same object travels in
a model profile (:attr:`galva_schema.ModelProfile.constraints`), so the planner never proposes what the runtime would
refuse.

:func:`plan_problems` is the only place that decides whether a :class:`~galva_schema.Strategy` can run on a model;
galva-train's command line, galva-hp's ``build`` and galva-search all call it. It returns *every* problem, each a
one-line ``<field path>: <what is wrong>``, with the same problem on several layers reported once
(``layers[0..3].tp: ...``).

The head rules, stated once here: a Megatron tp degree must divide the query heads and either divide the key/value
heads or be a multiple of them (each rank then computes the one K/V head its query heads use); a Ulysses degree
must divide the query heads only (K/V heads are repeated as needed).

The expert rules: a layer type with experts (``num_experts`` > 0) takes ``ep`` dividing its experts and ``etp``
dividing each expert's FFN size (``expert_ffn``); ``ep x etp`` divides the stage's ranks (checked by the strategy
itself); under plain tp the sequence divides by tp (each tp rank routes its slice of the tokens). Expert fields
on a dense layer of a model with experts elsewhere are ignored (a dense first layer takes the plan of its
neighbours); on a model without experts they are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from galva_schema._base import GalvaModel
from galva_schema.errors import group_problems
from galva_schema.sharding import sequence_cell_count
from galva_schema.strategy import Strategy
from galva_schema.vocabulary import DataParallelType, Precision

__all__ = [
    "LayerTypeConstraints",
    "ModelConstraints",
    "ParallelForm",
    "SharedParameter",
    "layers_problem",
    "plan_problems",
    "world_size_problem",
]


class ParallelForm(str, Enum):
    """A parallel form a layer (or the vocabulary layers) may lack. Degree 1, ddp and zero2 always run."""

    TP = "tp"  # Megatron tensor parallelism, degree > 1
    MEGATRON_SP = "megatron_sp"  # Megatron sequence parallelism on a tp > 1 layer
    ULYSSES = "ulysses"  # Ulysses sequence parallelism
    ZERO3 = "zero3"  # parameters sharded over the data-parallel group
    VOCAB_TP = "vocab_tp"  # vocabulary layers split over the vocabulary
    VOCAB_SP = "vocab_sp"  # vocabulary layers split over the sequence
    CP = "cp"  # context parallelism (ring attention), degree > 1; the vocabulary layers' too

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    ParallelForm.TP: "tensor parallelism",
    ParallelForm.MEGATRON_SP: "Megatron-SP",
    ParallelForm.ULYSSES: "Ulysses",
    ParallelForm.ZERO3: "ZeRO-3",
    ParallelForm.VOCAB_TP: "vocabulary tensor parallelism",
    ParallelForm.VOCAB_SP: "vocabulary sequence parallelism",
    ParallelForm.CP: "context parallelism",
}


class LayerTypeConstraints(GalvaModel):
    """What one kind of transformer layer can run. Types are contiguous runs of layers, in model order."""

    name: str = Field(description="Layer type, e.g. 'decoder', 't5_encoder', 'swin_stage1'.")
    num_layers: PositiveInt = Field(description="Consecutive layers of this type.")
    num_heads: PositiveInt = Field(description="Attention (query) heads.")
    num_kv_heads: PositiveInt | None = Field(None, description="Key/value heads; null means num_heads.")
    seq_length: PositiveInt | None = Field(
        None,
        description="Tokens at the layers' input when they do not follow the run's sequence length (T5: encoder "
        "plus decoder; an image model: its patch grid); null means the run's sequence length.",
    )
    output_seq_length: PositiveInt | None = Field(
        None, description="Tokens the type's last layer outputs when it changes them (e.g. patch merging)."
    )
    unsupported: dict[ParallelForm, str] = Field(
        default_factory=dict, description="Parallel forms these layers cannot run, each with the reason."
    )
    num_experts: NonNegativeInt = Field(0, description="Routed experts per layer; 0 for a dense layer.")
    expert_ffn: PositiveInt | None = Field(None, description="Each routed expert's FFN (intermediate) size.")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads


class SharedParameter(GalvaModel):
    """A parameter read by a contiguous run of layers (T5's relative-position tables). A fact about the model, not a
    restriction: galva-hp gives every rank that runs one of the layers a copy and sums its gradient over them
    (galva_hp.shared_params), so the layers may sit on any stages with any tp layout and data-parallel type."""

    name: str = Field(description="What is shared, e.g. 'encoder relative-position table'.")
    layers: tuple[NonNegativeInt, NonNegativeInt] = Field(description="First and last layer index, inclusive.")

    @model_validator(mode="after")
    def _check(self) -> SharedParameter:
        if self.layers[0] > self.layers[1]:
            raise ValueError(f"layers: first {self.layers[0]} is after last {self.layers[1]}")
        return self


class ModelConstraints(GalvaModel):
    """Everything a plan must respect to run on one model (see the module docstring)."""

    model_name: str
    layer_types: tuple[LayerTypeConstraints, ...] = Field(min_length=1)
    vocab_unsupported: dict[ParallelForm, str] = Field(
        default_factory=dict, description="Forms the embedding / head cannot run, each with the reason."
    )
    max_seq_length: PositiveInt | None = Field(None, description="Longest sequence (learned positions).")
    shared_parameters: tuple[SharedParameter, ...] = ()
    context_parallel: bool = Field(
        False,
        description="Whether the model's attention runs context-parallel (ring attention); a layer type may still "
        "refuse it (`unsupported`). Opt-in: a model whose attention knows nothing of a ring must not get one.",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelConstraints:
        for shared in self.shared_parameters:
            if shared.layers[1] >= self.num_layers:
                raise ValueError(
                    f"shared_parameters: {shared.name!r} names layer {shared.layers[1]} of a "
                    f"{self.num_layers}-layer model"
                )
        return self

    @property
    def num_layers(self) -> int:
        return sum(t.num_layers for t in self.layer_types)

    def layer_type_of(self, index: int) -> LayerTypeConstraints:
        """The constraints of transformer layer ``index``."""
        for layer_type in self.layer_types:
            if index < layer_type.num_layers:
                return layer_type
            index -= layer_type.num_layers
        raise IndexError(f"layer {index} out of range for a model of {self.num_layers} layers")

    def last_layer_of_types(self) -> set[int]:
        """Indices of the last layer of every type (where ``output_seq_length`` applies)."""
        ends, total = set(), 0
        for layer_type in self.layer_types:
            total += layer_type.num_layers
            ends.add(total - 1)
        return ends


def head_problem(layer_type: LayerTypeConstraints, degree: int, ulysses: bool) -> str | None:
    """Why a model-parallel ``degree`` cannot split this layer type's heads (None if it can)."""
    if degree == 1:
        return None
    return heads_problem(layer_type.num_heads, layer_type.kv_heads, degree, ulysses, f" of {layer_type.name} layers")


def heads_problem(heads: int, kv_heads: int, degree: int, ulysses: bool, where: str = "") -> str | None:
    """Why ``degree`` ranks of tp (or Ulysses) cannot split ``heads`` query and ``kv_heads`` key/value heads (None
    if they can): the one rule the plan check and the attention modules ask. ``where`` follows the heads' count."""
    if heads % kv_heads:
        return f"the {heads} attention heads{where} are not a multiple of their {kv_heads} key/value heads"
    if degree == 1:
        return None
    kind = "Ulysses degree" if ulysses else "tp"
    if heads % degree:
        return f"{kind} {degree} does not divide the {heads} attention heads{where}"
    if not ulysses and kv_heads % degree and degree % kv_heads:
        return f"tp {degree} and the {kv_heads} key/value heads{where} do not divide one another"
    return None


def layer_forms(strategy: Strategy, index: int) -> list[ParallelForm]:
    """The parallel forms layer ``index`` of ``strategy`` needs (beyond degree 1 and ddp / zero2)."""
    layer, forms = strategy.layers[index], []
    if layer.tp > 1:
        forms.append(ParallelForm.ULYSSES if layer.ulysses else ParallelForm.TP)
        if strategy.megatron_sp and not layer.ulysses:
            forms.append(ParallelForm.MEGATRON_SP)
    if layer.cp > 1:
        forms.append(ParallelForm.CP)
    if strategy.layer_dp_type(index) is DataParallelType.ZERO3:
        forms.append(ParallelForm.ZERO3)
    return forms


def vocab_forms(strategy: Strategy) -> list[ParallelForm]:
    """The parallel forms the vocabulary layers of ``strategy`` need."""
    forms = []
    if strategy.vocab.tp > 1:
        forms.append(ParallelForm.VOCAB_SP if strategy.vocab.sp else ParallelForm.VOCAB_TP)
        if strategy.megatron_sp and not strategy.vocab.sp:
            forms.append(ParallelForm.MEGATRON_SP)
    if strategy.vocab.cp > 1:
        forms.append(ParallelForm.CP)
    if strategy.vocab_dp_type is DataParallelType.ZERO3:
        forms.append(ParallelForm.ZERO3)
    return forms


_FORM_FIELD = {
    ParallelForm.TP: ".tp",
    ParallelForm.MEGATRON_SP: ".tp",
    ParallelForm.ULYSSES: ".ulysses",
    ParallelForm.ZERO3: ".dp_type",
    ParallelForm.VOCAB_TP: ".tp",
    ParallelForm.VOCAB_SP: ".sp",
    ParallelForm.CP: ".cp",
}


def plan_problems(
    strategy: Strategy,
    constraints: ModelConstraints,
    *,
    world_size: int | None = None,
    seq_len: int | None = None,
) -> list[str]:
    """Every reason ``strategy`` cannot run on the model ``constraints`` describe (empty: it can).

    ``world_size`` is the number of ranks of the run and ``seq_len`` its sequence length, each checked when given.
    A strategy is already valid on its own (pydantic validation); this adds what depends on the model and the run.
    """
    problems: list[str] = []
    if world_size is not None and (world := world_size_problem(strategy, world_size)):
        problems.append(world)
    if strategy.mixed_precision is Precision.FP16:
        problems.append("mixed_precision: fp16 needs loss scaling, which Galva does not do; use bf16 or fp32")
    if seq_len is not None and constraints.max_seq_length is not None and seq_len > constraints.max_seq_length:
        problems.append(f"seq_len: {seq_len} exceeds the model's {constraints.max_seq_length} learned positions")
    if layers := layers_problem(strategy, constraints.num_layers, constraints.model_name):
        problems.append(layers)
        return problems  # per-layer checks would compare the wrong layers
    problems += group_problems(_layer_problems(strategy, constraints, seq_len))
    problems += group_problems(_expert_problems(strategy, constraints, seq_len))
    problems += _vocab_problems(strategy, constraints, seq_len)
    return list(dict.fromkeys(problems))


def world_size_problem(strategy: Strategy, world_size: int) -> str | None:
    """Why ``strategy`` does not fit a run (or a cluster) of ``world_size`` ranks; None when it does."""
    if strategy.world_size == world_size:
        return None
    return f"world_size: the strategy has {strategy.world_size} ranks but the run has {world_size}"


def layers_problem(strategy: Strategy, num_layers: int, model_name: str) -> str | None:
    """Why ``strategy`` does not fit the ``num_layers`` layers of ``model_name``; None when it does."""
    if strategy.num_layers == num_layers:
        return None
    return f"layers: the strategy has {strategy.num_layers} layers but {model_name} has {num_layers}"


def _layer_problems(
    strategy: Strategy, constraints: ModelConstraints, seq_len: int | None
) -> list[tuple[str, int | None, str, str]]:
    found: list[tuple[str, int | None, str, str]] = []
    type_ends = constraints.last_layer_of_types()
    for index, layer in enumerate(strategy.layers):
        layer_type = constraints.layer_type_of(index)
        for form in layer_forms(strategy, index):
            reason = layer_type.unsupported.get(form) or _no_ring(constraints, form)
            if reason is not None:
                found.append(("layers", index, _FORM_FIELD[form], _refusal(layer_type.name, form, reason)))
        heads = head_problem(layer_type, layer.tp, layer.ulysses)
        if heads:
            found.append(("layers", index, ".tp", heads))
        shards = strategy.layer_sequence_shards(index)
        tokens = layer_type.seq_length or seq_len
        if layer.cp > 1 and tokens is not None and tokens % sequence_cell_count(layer.cp, shards):
            found.append(("layers", index, ".cp", _cp_problem(layer.cp, shards, tokens)))
        if shards == 1:
            continue
        kind = "Ulysses" if layer.ulysses else "Megatron-SP"
        if tokens is not None and tokens % shards:
            found.append(
                ("layers", index, ".tp", f"{kind} degree {shards} does not divide the sequence of {tokens} tokens")
            )
        output = layer_type.output_seq_length
        if index in type_ends and output is not None and output % shards:
            found.append(
                ("layers", index, ".tp", f"{kind} degree {shards} does not divide the {output} tokens of its output")
            )
    return found


def _expert_problems(
    strategy: Strategy, constraints: ModelConstraints, seq_len: int | None
) -> list[tuple[str, int | None, str, str]]:
    found: list[tuple[str, int | None, str, str]] = []
    has_experts = any(t.num_experts for t in constraints.layer_types)
    for index, layer in enumerate(strategy.layers):
        layer_type = constraints.layer_type_of(index)
        if not has_experts:
            for name, degree in (("ep", layer.ep), ("etp", layer.etp)):
                if degree > 1:
                    found.append(("layers", index, f".{name}", f"{constraints.model_name} has no expert layers"))
            continue
        if not layer_type.num_experts:
            continue
        if layer_type.num_experts % layer.ep:
            found.append(
                ("layers", index, ".ep",
                 f"ep {layer.ep} does not divide the {layer_type.num_experts} experts of {layer_type.name} layers")
            )  # fmt: skip
        tokens = layer_type.seq_length or seq_len
        if strategy.layer_sequence_shards(index) == 1 and layer.tp_degree > 1 and tokens and tokens % layer.tp:
            found.append(
                ("layers", index, ".tp",
                 f"tp {layer.tp} does not divide the sequence of {tokens} tokens (each tp rank routes its slice "
                 f"of them to the experts)")
            )  # fmt: skip
        ffn = layer_type.expert_ffn
        if layer.etp > 1 and (ffn is None or ffn % layer.etp):
            size = "an unknown size" if ffn is None else f"size {ffn}"
            found.append(
                ("layers", index, ".etp",
                 f"etp {layer.etp} does not divide the expert FFN ({size}) of {layer_type.name} layers")
            )  # fmt: skip
    return found


def _vocab_problems(strategy: Strategy, constraints: ModelConstraints, seq_len: int | None) -> list[str]:
    found = []
    for form in vocab_forms(strategy):
        reason = constraints.vocab_unsupported.get(form) or _no_ring(constraints, form)
        if reason is not None:
            found.append(f"vocab{_FORM_FIELD[form]}: {_refusal('the vocabulary', form, reason)}")
    shards = strategy.vocab_sequence_shards
    cp = strategy.vocab.cp
    if cp > 1 and seq_len is not None and seq_len % sequence_cell_count(cp, shards):
        found.append(f"vocab.cp: {_cp_problem(cp, shards, seq_len)}")
    if shards > 1 and seq_len is not None and seq_len % shards:
        kind = "sequence-parallel" if strategy.vocab.sp else "Megatron-SP"
        found.append(f"vocab.tp: {kind} degree {shards} does not divide the sequence of {seq_len} tokens")
    return found


def _no_ring(constraints: ModelConstraints, form: ParallelForm) -> str | None:
    if form is ParallelForm.CP and not constraints.context_parallel:
        return f"{constraints.model_name}'s attention has no ring form (its adapter does not run it)"
    return None


def _cp_problem(cp: int, shards: int, tokens: int) -> str:
    cells = sequence_cell_count(cp, shards)
    parts = f"2 x cp {cp}" + (f" x {shards} sequence shards" if shards > 1 else "")
    return f"the sequence of {tokens} tokens does not divide into {cells} equal chunks ({parts})"


def _refusal(what: str, form: ParallelForm, reason: str) -> str:
    owner = what if what == "the vocabulary" else f"{what} layers"
    return f"{owner} cannot run {form.label}: {reason}"


def uniform_constraints(
    model_name: str,
    layer_type: str,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    *,
    unsupported: dict[ParallelForm, str] | None = None,
    max_seq_length: int | None = None,
    context_parallel: bool = False,
    num_experts: int = 0,
    expert_ffn: int | None = None,
) -> ModelConstraints:
    """Constraints of a model whose transformer layers are all of one type (GPT, Llama, BERT, ViT...)."""
    return ModelConstraints(
        model_name=model_name,
        layer_types=(
            LayerTypeConstraints(
                name=layer_type,
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                unsupported=unsupported or {},
                num_experts=num_experts,
                expert_ffn=expert_ffn,
            ),
        ),
        max_seq_length=max_seq_length,
        context_parallel=context_parallel,
    )


def supported_degrees(layer_type: LayerTypeConstraints, degrees: Sequence[int], ulysses: bool) -> list[int]:
    """The degrees among ``degrees`` whose head split works for this layer type (for a planner's space)."""
    return [d for d in degrees if head_problem(layer_type, d, ulysses) is None]
