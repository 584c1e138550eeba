"""Galva's modules cut from a Hugging Face model where it stands: the embedding side, each layer, the head.

Each holds the Hugging Face submodules themselves (no copies), under their Hugging Face names, and runs the
family's own code around them:

- what the model's forward hands each layer (masks, position embeddings for that layer's type, position ids, ...)
  is computed by that forward itself: :class:`LayerInputs` runs the base model with stand-ins for its layers that
  record their arguments (cached per batch shape, dtype and device);
- the embedding side is the base model's forward up to the first layer (embedding scales, multipliers, dropout);
- the head is the task model's forward after the base model (final norm, ``lm_head``, logit soft-capping or
  scaling), then the token loss.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp import IGNORE_INDEX
from galva_hp.parallel.gather_state import param_or_grad
from galva_hp.parallel.mappings import (
    differentiable_gather_replicated,
    differentiable_split,
    group_rank,
    sum_grad_over,
)
from galva_hp.parallel.rng import rank_stream
from galva_hp.parallel.vocab import vocab_parallel_loss_sum
from galva_models.tables.errors import UnsupportedModel
from galva_models.tables.hooks import layer_lists, layer_stack
from galva_models.tables.positions import cut_to_positions, sequence_axes
from galva_models.tables.sharding import Split, TpRegion, gather_split
from galva_schema.sharding import sequence_blocks

__all__ = [
    "LayerInputs",
    "ModuleForm",
    "Shared",
    "TableEmbedding",
    "TableHead",
    "TableLayer",
    "first_output",
    "token_loss_sum",
]


def first_output(out: Any) -> Tensor:
    """Hugging Face layers return a tensor or a tuple whose first item is the hidden state."""
    return out[0] if isinstance(out, (tuple, list)) else out


def token_loss_sum(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Sum of fp32 cross-entropy over scored tokens (label != -100) and the number of scored tokens."""
    flat = labels.reshape(-1)
    loss_sum = F.cross_entropy(
        logits.reshape(flat.numel(), -1).float(), flat, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (flat != IGNORE_INDEX).sum()


class Shared:
    """A reference that copies of its holder share (``copy.deepcopy`` does not follow it): the whole model."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict[int, Any]) -> Shared:
        return self


class _Stop(Exception):
    """Raised by the last stand-in a pass needs: the rest of the forward is not run."""


class _StandIn(nn.Module):
    """Stands for layer ``index`` during a recording pass: records what the forward hands it."""

    def __init__(self, real: nn.Module, index: int, sink: dict[int, Any], stop: int) -> None:
        super().__init__()
        self._real = Shared(real)
        self.index, self.sink, self.stop = index, sink, stop

    def __getattr__(self, name: str) -> Any:  # a forward may read a layer's attributes (its attention type)
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_real":  # not set yet (or a copy being built): no layer to ask
                raise
            return getattr(self._real.value, name)

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.index in self.sink:  # Galva runs each layer once, in order
            raise UnsupportedModel(
                f"{type(self._real.value).__name__} {self.index} is run more than once by its model's forward (a "
                "recurrence over the layer stack), which Galva's one pass per layer does not compute"
            )
        self.sink[self.index] = (hidden_states, args, kwargs)
        if self.index >= self.stop:
            raise _Stop
        return hidden_states


class _Zeros(nn.Module):
    """Stands for an embedding-side module while a layer's arguments are recorded: zeros of the hidden width (a
    learned position table added to the input changes no argument). Its other attributes are the real module's (a
    forward may read a weight's dtype)."""

    def __init__(self, hidden: int, dtype: torch.dtype, real: nn.Module) -> None:
        super().__init__()
        self.hidden, self.dtype = hidden, dtype
        self._real = Shared(real)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_real":
                raise
            return getattr(self._real.value, name)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        x = next(v for v in (*args, *kwargs.values()) if isinstance(v, Tensor))  # called either way
        if x.is_floating_point() and x.shape[-1] == self.hidden:
            return torch.zeros_like(x)
        return torch.zeros(*x.shape, self.hidden, dtype=self.dtype, device=x.device)


def _view(module: nn.Module, overrides: dict[str, nn.Module], training: bool) -> nn.Module:
    """``module`` with some submodules replaced (by dotted path: a nested layer list), for one call, in the caller's
    mode (a forward may read ``self.training``: Starcoder 2's embedding dropout); ``module`` itself is untouched."""
    children = {name: sub for name, sub in overrides.items() if "." not in name}
    nested: dict[str, dict[str, nn.Module]] = {}
    for path, sub in overrides.items():
        if "." in path:
            head, rest = path.split(".", 1)
            nested.setdefault(head, {})[rest] = sub
    for head, inner in nested.items():
        children[head] = _view(children.get(head, getattr(module, head)), inner, training)
    view = copy.copy(module)
    view._modules = {**module._modules, **children}
    view.training = training
    return view


def embeds_keyword(inputs: str) -> str:
    """The keyword a forward takes ready hidden states by: ``inputs_embeds`` for token models; a model without one
    (pixels) takes them where its input goes (the embedding side is a stand-in then)."""
    return "inputs_embeds" if inputs == "input_ids" else inputs


def materialized_copy(module: nn.Module, model: Any) -> nn.Module:
    """A copy of a parameter-free module (a rotary embedding), on the CPU with its buffers computed when the model
    was built on the meta device."""
    out = copy.deepcopy(module)
    if any(b.is_meta for b in out.buffers()):
        out.to_empty(device="cpu")
        for sub in out.modules():
            model._init_weights(sub)
    return out


class LayerInputs(nn.Module):
    """What the base model's forward hands each layer, computed by that forward.

    ``context`` holds copies of the parameter-free modules the forward uses before its layers (the rotary
    embedding), so every Galva module can run it on its own stage. The base model itself is shared, not held.
    """

    def __init__(
        self,
        base: nn.Module,
        layers: str,
        context: dict[str, nn.Module],
        before: tuple[str, ...],
        inputs: str = "input_ids",
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
    ) -> None:
        """``calls``: each layer's ``(args, kwargs)`` where the config fixes them (:class:`~.hooks.LayerShape`);
        None: recorded from the base forward."""
        super().__init__()
        self.context = nn.ModuleDict(context)
        self._base = Shared(base)
        self._layers = layers
        self._before = before
        self._embeds = embeds_keyword(inputs)
        self._calls = calls
        self._cache: dict[tuple[Any, ...], dict[int, Any]] = {}
        self._axes: dict[tuple[Any, ...], dict[int, Any]] = {}

    def run(self, stop: int, overrides: dict[str, nn.Module], **inputs: Any) -> dict[int, Any]:
        """Run the base forward with stand-ins for its layers up to layer ``stop``: ``{index: (hidden, args,
        kwargs)}``. ``overrides`` replace base modules (this Galva module's own copies)."""
        base = self._base.value
        sink: dict[int, Any] = {}
        stand_ins: dict[str, nn.Module] = {}
        index = 0
        for path, real in layer_lists(base, self._layers):  # one list, or one per stage
            stand_ins[path] = nn.ModuleList([_StandIn(layer, index + i, sink, stop) for i, layer in enumerate(real)])
            index += len(real)
        view = _view(base, {**dict(self.context.items()), **overrides, **stand_ins}, self.training)
        with contextlib.suppress(_Stop):
            type(base).forward(view, **inputs, use_cache=False)
        return sink

    def layer_call(self, index: int, batch: int, seq: int, dtype: torch.dtype, device: torch.device) -> Any:
        """``(args, kwargs)`` the forward hands layer ``index`` for a ``[batch, seq]`` input (the whole sequence)."""
        if self._calls is not None:
            return self._calls[index]
        key = (batch, seq, dtype, device)
        if key not in self._cache:
            self._cache = {key: self._record(batch, seq, dtype, device)}
        return self._cache[key][index]

    def local_call(
        self, index: int, batch: int, seq: int, positions: Tensor, dtype: torch.dtype, device: torch.device
    ) -> Any:
        """:meth:`layer_call` for a rank holding ``positions`` of a ``seq``-token sequence: every argument with one
        entry per position cut to them (:mod:`.positions`: the axes found from a second recording at half the
        length); masks and other pairwise arguments whole (the attention function sees the whole sequence)."""
        args, kwargs = self.layer_call(index, batch, seq, dtype, device)
        key = (batch, seq, dtype, device)
        if key not in self._axes:
            # keyword arguments only, as the forward hands position tables and ids (a positional mask stays whole)
            whole = self._cache[key] if self._calls is None else dict(enumerate(self._calls))
            # a shorter recording: never past a position table's end
            other = self._record(batch, seq // 2, dtype, device) if self._calls is None else {}
            self._axes = {key: {i: sequence_axes(kw, other.get(i, (None, None))[1]) for i, (_, kw) in whole.items()}}
        return args, cut_to_positions(kwargs, self._axes[key][index], positions)

    def _record(self, batch: int, seq: int, dtype: torch.dtype, device: torch.device) -> dict[int, Any]:
        hidden = self._base.value.config.hidden_size
        embeds = torch.zeros(batch, seq, hidden, dtype=dtype, device=device)
        base = self._base.value
        n = len(layer_stack(base, self._layers))
        # the embedding side may live on another stage (or the meta device): stand-ins of the right width
        quiet: dict[str, nn.Module] = {n: _Zeros(hidden, dtype, base.get_submodule(n)) for n in self._before}
        with torch.no_grad():  # arguments, not activations: nothing here is saved for a backward
            recorded = self.run(n - 1, quiet, **{self._embeds: embeds})
        return {i: (args, kwargs) for i, (_, args, kwargs) in recorded.items()}


@dataclass
class ModuleForm:
    """A Galva module's parallel form, set in place by the parallelizer: its region and what it asks of the runtime."""

    region: TpRegion | None = None
    grad_sums: list[tuple[str, ProcessGroup]] = field(default_factory=list)
    """Parameters (by name in the module) whose gradient the runtime sums over the group."""
    seq_group: ProcessGroup | None = None
    """The group over which the module's boundary activations hold slices of the sequence."""
    seq_shards: int = 1
    ulysses: bool = False
    vocab_group: ProcessGroup | None = None
    """Head under vocabulary tp: the group its logits are split over (its labels are a sequence slice when
    ``seq_group`` is set: Megatron-SP)."""
    whole: bool = False
    """The module runs on the whole sequence although its boundary is ``seq_group``'s slice: an embedding splits
    its output, a head gathers its input (every rank then computes the same)."""
    cp: int = 1
    """Context-parallel degree: the module's boundaries hold this rank's two chunks of the sequence (split further
    over ``seq_group``)."""
    cp_index: int = 0

    def positions(self, local: int, device: torch.device, split: bool = True) -> tuple[int, Tensor | None]:
        """``(seq_len, positions)`` for a boundary of ``local`` tokens: the whole sequence's length and the
        positions this rank's boundary holds, in order (with ``split`` false, those of its context-local sequence);
        None where they are the whole sequence."""
        shards = self.seq_shards if split else 1
        seq = local * self.cp * self.seq_shards
        if self.cp == 1 and shards == 1:
            return seq, None
        index = group_rank(self.seq_group) if shards > 1 else 0
        blocks = sequence_blocks(seq, self.cp, shards, self.cp_index, index)
        return seq, torch.cat([torch.arange(b.start, b.stop, device=device) for b in blocks])


class _InPlace(nn.Module):
    """Common to the three: the parallel form, the gradient sums it asks for, and ``gather_full``."""

    form: ModuleForm | None

    def _begin(self) -> None:
        if self.form is None:
            return
        for name, group in self.form.grad_sums:
            sum_grad_over(self.get_parameter(name), group)  # the parameter forward uses (FSDP2's gathered one)

    def _end(self) -> None:
        if self.form is not None and self.form.region is not None:
            self.form.region.clear()

    def _streams(self, device: torch.device) -> Any:
        """Dropout on a sequence slice: this rank's own stream (:mod:`galva_hp.parallel.rng`)."""
        if self.form is None or self.form.seq_group is None or not self.training:
            return contextlib.nullcontext()
        return rank_stream(self.form.seq_group, device)

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        """The single-process parameters (or gradients) under this module's names; split ones are gathered."""
        out = {}
        for name, param in self.named_parameters():
            value = param_or_grad(param, grads)
            inner: Split | None = getattr(param, "galva_split_inner", None)  # an expert under etp and ep
            if inner is not None:
                value = gather_split(value, inner)
            split: Split | None = getattr(param, "galva_split", None)
            out[name] = value if split is None else gather_split(value, split)
        return out


class TableEmbedding(_InPlace):
    """The base model's modules before its layers (``embed_tokens``, an embedding dropout), run by its own forward
    on the model input (token ids, or pixels: ``inputs`` names the forward's keyword)."""

    def __init__(self, modules: dict[str, nn.Module], inputs: LayerInputs, keyword: str = "input_ids") -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self.inputs = inputs
        self._names = tuple(modules)
        self._keyword = keyword
        self.form = None

    def forward(self, input_ids: Tensor) -> Tensor:
        self._begin()
        extra: dict[str, Any] = {}
        form = self.form
        sliced = form is not None and (form.seq_group is not None or form.cp > 1) and not form.whole
        if sliced:  # its output: this rank's positions
            assert form is not None
            # vocabulary sp: the ids are that slice already; Megatron-SP: the token table's sum is scattered
            local = input_ids.shape[1] if form.ulysses else input_ids.shape[1] // form.seq_shards
            _, positions = form.positions(local, input_ids.device)
            assert positions is not None
            extra["position_ids"] = positions.unsqueeze(0)
        elif form is not None and form.whole and form.cp > 1:  # whole, but of this rank's two context chunks
            _, positions = form.positions(input_ids.shape[1] // form.seq_shards, input_ids.device, split=False)
            assert positions is not None
            extra["position_ids"] = positions.unsqueeze(0)
        overrides = {name: getattr(self, name) for name in self._names}
        with self._streams(input_ids.device) if sliced else contextlib.nullcontext():
            recorded = self.inputs.run(0, overrides, **{self._keyword: input_ids}, **extra)
        self._end()
        out = recorded[0][0]  # what the forward hands the first layer
        if form is not None and form.whole and form.seq_group is not None:
            out = differentiable_split(out, 1, form.seq_group)
        return out


class TableLayer(_InPlace):
    """One Hugging Face layer (``layer``), called as the model's forward calls it; where it ends a stage, the
    stage's own module that follows it (``end``: Swin's patch merging, under its Hugging Face name), called on its
    output with the same arguments."""

    def __init__(
        self, layer: nn.Module, index: int, inputs: LayerInputs | None, end: tuple[str, nn.Module] | None = None
    ) -> None:
        """``inputs``: what the base forward hands the layer (None: a family's hook calls it itself, T5's)."""
        super().__init__()
        self.layer = layer
        self.index = index
        self.inputs = inputs
        self.form = None
        self._end_name = None if end is None else end[0]
        if end is not None:
            self.add_module(*end)

    def forward(self, hidden: Tensor) -> Tensor:
        form = self.form
        batch, local = hidden.shape[:2]
        assert self.inputs is not None
        if form is None:
            args, kwargs = self.inputs.layer_call(self.index, batch, local, hidden.dtype, hidden.device)
        else:
            # the positions attention's inputs hold: this rank's slice under Ulysses (its all-to-all gathers the
            # rest after the rotary embedding); the context-local sequence otherwise (Megatron-SP gathers it first)
            seq, positions = form.positions(local, hidden.device, split=form.ulysses)
            if positions is None:
                args, kwargs = self.inputs.layer_call(self.index, batch, seq, hidden.dtype, hidden.device)
            else:
                args, kwargs = self.inputs.local_call(self.index, batch, seq, positions, hidden.dtype, hidden.device)
        self._begin()
        with self._streams(hidden.device):
            out = first_output(self.layer(hidden, *args, **kwargs))
            if self._end_name is not None:
                out = getattr(self, self._end_name)(out, *args)
        self._end()
        return out


def _hidden_output() -> Any:
    """A base-model output holding the hidden state; any other field a task model reads (router logits, cross
    attentions) is None."""
    global _HIDDEN_OUTPUT
    if _HIDDEN_OUTPUT is None:
        from dataclasses import dataclass as model_output

        from transformers.utils import ModelOutput

        @model_output
        class HiddenOutput(ModelOutput):
            last_hidden_state: Tensor | None = None
            pooler_output: Tensor | None = None

            def __getattr__(self, name: str) -> Any:
                if name.startswith("__"):
                    raise AttributeError(name)
                return None

        _HIDDEN_OUTPUT = HiddenOutput
    return _HIDDEN_OUTPUT


_HIDDEN_OUTPUT: Any = None


class _BaseOutput(nn.Module):
    """Stands for the base model in the task model's forward: the hidden state after the final modules."""

    def __init__(self, after: nn.ModuleDict, keyword: str, tail: Callable[..., dict[str, Any]] | None) -> None:
        super().__init__()
        self.after = after
        self.keyword = keyword
        self.tail = tail

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = kwargs[self.keyword] if kwargs.get(self.keyword) is not None else args[0]
        if self.tail is not None:  # the family's hook: more than the modules in turn (Swin's pooler)
            return _hidden_output()(**self.tail(dict(self.after.items()), hidden))
        for module in self.after.values():
            hidden = module(hidden)
        return _hidden_output()(last_hidden_state=hidden)


class TableHead(_InPlace):
    """The base model's modules after its layers (the final norm), the task model's own head modules (``lm_head``,
    BERT's ``cls``, a ``classifier``) and the loss, run by the task model's own forward: ``(hidden, labels) ->
    (loss_sum, count)``; the loss is per token, or per sample where the labels are one per sample (images)."""

    def __init__(
        self,
        after: dict[str, nn.Module],
        head: dict[str, nn.Module],
        task_model: nn.Module,
        base: str,
        keyword: str = "input_ids",
        tail: Callable[..., dict[str, Any]] | None = None,
    ) -> None:
        """``tail``: the table's hook for the base model's forward after its layers (None: ``after`` in turn)."""
        super().__init__()
        self._tail = tail
        for name, module in {**after, **head}.items():
            self.add_module(name, module)
        self._after = tuple(after)
        self._head = tuple(head)
        self._task = Shared(task_model)
        self._base_name = base
        self._keyword = embeds_keyword(keyword)
        self.aliases = _aliases(self)
        self.form = None

    def forward(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        self._begin()
        form = self.form
        if form is not None and form.whole and form.seq_group is not None:
            hidden = differentiable_gather_replicated(hidden, 1, form.seq_group)
        task = self._task.value
        base = _BaseOutput(nn.ModuleDict({n: getattr(self, n) for n in self._after}), self._keyword, self._tail)
        view = _view(task, {self._base_name: base, **{n: getattr(self, n) for n in self._head}}, self.training)
        with self._streams(hidden.device) if form is None or not form.whole else contextlib.nullcontext():
            logits = type(task).forward(view, **{self._keyword: hidden}, use_cache=False).logits
        self._end()
        if form is not None and form.vocab_group is not None:
            vocab = _classes(task.config, labels)
            sequence_split = form.seq_group is not None and not form.whole
            return vocab_parallel_loss_sum(logits, labels, form.vocab_group, vocab, sequence_split)
        return token_loss_sum(logits, labels)


def _aliases(module: nn.Module) -> dict[str, str]:
    """Second name -> first name of every parameter ``module`` holds under two names (a tie inside it)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out[name] = first[id(param)]
        else:
            first[id(param)] = name
    return out


def _classes(config: Any, labels: Tensor) -> int:
    """The logits' real width: the vocabulary (token labels) or the label count (one label per sample)."""
    if labels.dim() == 1:
        return int(config.num_labels)
    return int(config.get_text_config().vocab_size)
