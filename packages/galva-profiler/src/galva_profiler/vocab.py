"""Embedding, final norm, head and loss: time (tp 1) and memory per vocabulary tp degree and pipeline position.

Positions follow the profile: ``pp_off`` (all vocabulary modules on one stage), ``pp_first`` (the embedding, on the
first stage) and ``pp_last`` (norm, head and loss, on the last stage). Model states are the parameter elements a
rank holds in the module's vocabulary-parallel form (built in a gloo group of ``k`` forked ranks, as for layers)
times the bytes galva-hp holds per parameter under ddp (:data:`STATE_BYTES_PER_PARAMETER`: fp32 4 + 4 + 8 = 16;
bf16 2 + 4 + 12 = 18, the bf16 compute weight, its fp32 gradient, the fp32 master and Adam's two moments; galva-search's
``state_accounting="galva-hp"``). A weight tied between embedding and head is one shared weight
(``galva_hp.shared_params``): the embedding holds its full states; on one stage (``pp_off``) the head reads that very
tensor and holds nothing more, on the last stage (``pp_last``) it holds a copy, its compute weight and fp32 gradient
(:func:`copy_bytes_per_parameter`) but no master and no AdamW moments. Activations are saved-tensor bytes per local
sample.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from galva_profiler.activation_memory import saved_bytes
from galva_profiler.layer_timing import PassTimes, on_device, time_interleaved
from galva_profiler.timing import Repeats
from galva_schema import VocabForm

STATE_BYTES_PER_PARAMETER = {torch.float32: 16, torch.bfloat16: 18, torch.float16: 18}
"""Model-state bytes galva-hp holds per parameter under ddp with AdamW, by compute dtype (measured by
``galva-profile check``; galva-search's ``state_bytes_per_parameter`` with ``state_accounting="galva-hp"``)."""
GRADIENT_BYTES = 4
"""galva-hp's gradients are fp32 whatever the compute dtype."""


def copy_bytes_per_parameter(dtype: torch.dtype) -> int:
    """Bytes per parameter of a tied weight's copy off its home stage: the compute weight and its gradient (the
    master and AdamW's moments are the home's; in bf16 6 of the 18, measured by ``galva-profile check``)."""
    return dtype.itemsize + GRADIENT_BYTES


POSITIONS = ("pp_off", "pp_first", "pp_last")
MIB = 2**20


def _head_ties(layered: Any) -> list[tuple[str, str]]:
    """``(path in the embedding, path in the head)`` of every weight the head holds tied to the embedding."""
    return [(w.path, path) for w in layered.shared for user, path in w.held.items() if user == "head"]


def tie(layered: Any) -> None:
    """Make tied head weights the embedding's tensors again (materialising each module gave each its own copy)."""
    for emb_path, head_path in _head_ties(layered):
        source = layered.embedding.get_parameter(emb_path)
        owner_path, _, attr = head_path.rpartition(".")
        owner = layered.head.get_submodule(owner_path) if owner_path else layered.head
        setattr(owner, attr, source)


def _tied(layered: Any) -> tuple[str, ...]:
    """The head's names (in the head module) of the weights it ties to the embedding."""
    return tuple(head_path for _, head_path in _head_ties(layered))


@dataclass
class VocabMeasurement:
    """Per degree and position: MiB of model states and MiB of activations per local sample."""

    times: dict[int, PassTimes] = field(default_factory=dict)  # batch -> times of embedding + head + loss
    model_states_mib: dict[str, dict[int, float]] = field(default_factory=dict)
    activation_mib_per_sample: dict[str, dict[int, float]] = field(default_factory=dict)
    forms: dict[str, dict[int, VocabForm]] = field(default_factory=dict)  # form -> degree -> beyond the plain modules

    def to_dict(self) -> dict[str, Any]:
        return {
            "forward_ms": {b: t.forward_ms for b, t in self.times.items()},
            "backward_ms": {b: t.backward_ms for b, t in self.times.items()},
            "model_states_mib": self.model_states_mib,
            "activation_mib_per_sample": self.activation_mib_per_sample,
            "forms": {
                name: {k: f.model_dump(mode="json") for k, f in by_degree.items()}
                for name, by_degree in self.forms.items()
            },
        }


@dataclass(frozen=True)
class VocabInputs:
    """What the embedding reads and what the head's loss takes, for the model's task: token ids and a label per
    token (language models), or images and a label per sample (image classifiers: ``image`` is ``(channels, size)``).
    """

    seq: int
    vocab: int  # token ids in [0, vocab), or the classes of an image label
    image: tuple[int, int] | None = None
    dtype: torch.dtype = torch.float32
    head_input: tuple[int, int] | None = None
    """``(sequence, hidden)`` the head reads where the layers change them (Swin's patch merging); None: the
    embedding's output."""
    label_seq: int | None = None
    """Tokens a sample's loss scores where fewer than it embeds (an encoder-decoder embeds ``[encoder ; decoder]``
    ids and scores the decoder's); None: ``seq``."""

    @classmethod
    def of(
        cls, config: Any, seq: int, dtype: torch.dtype, images: bool, head_input: tuple[int, int] | None = None,
        label_seq: int | None = None,
    ) -> VocabInputs:  # fmt: skip
        """The inputs of ``config``'s model: images (an image classifier's task) or tokens."""
        if images:
            image = (int(config.num_channels), int(config.image_size))
            return cls(seq, int(config.num_labels), image, dtype, head_input)
        return cls(seq, int(config.vocab_size), None, dtype, head_input, label_seq)

    @property
    def head_seq(self) -> int:
        """The sequence the head reads."""
        return self.seq if self.head_input is None else self.head_input[0]

    @property
    def token_vocab(self) -> int | None:
        """The vocabulary of token inputs (None for images)."""
        return None if self.image is not None else self.vocab

    def make(self, batch: int) -> tuple[Tensor, Tensor]:
        if self.image is not None:
            channels, size = self.image
            pixels = torch.randn(batch, channels, size, size, dtype=self.dtype)
            return pixels, torch.randint(0, self.vocab, (batch,))
        labels = torch.randint(0, self.vocab, (batch, self.label_seq or self.seq))
        return torch.randint(0, self.vocab, (batch, self.seq)), labels

    def labels_of(self, labels: Tensor, offset: int, local_seq: int) -> Tensor:
        """A rank's labels when its head sees ``local_seq`` positions from ``offset`` (a label per sample: all)."""
        return labels if self.image is not None else labels[:, offset : offset + local_seq]


def _unique_elements(*modules: nn.Module) -> int:
    seen: dict[int, int] = {}
    for module in modules:
        for p in module.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def _position_bytes(
    embedding: nn.Module, head: nn.Module, inputs: VocabInputs, local_seq: int, hidden: int, dtype: torch.dtype,
    rank_offset: int, tied: tuple[str, ...] = (),
) -> dict[str, tuple[int, int]]:  # fmt: skip
    """``{position: (model-state bytes, activation bytes per sample)}`` for one rank's modules; ``tied``: the head's
    names of its tied weights (on the embedding's stage the head reads the embedding's tensor; on its own stage its
    copy keeps no AdamW moments)."""

    def embed_at(b: int) -> Tensor:
        ids, _ = inputs.make(b)
        return embedding(ids)

    head_hidden = hidden if inputs.head_input is None else inputs.head_input[1]

    def head_at(b: int) -> Any:
        hidden_in = torch.randn(b, local_seq, head_hidden, dtype=dtype, requires_grad=True)
        _, labels = inputs.make(b)
        return head(hidden_in, inputs.labels_of(labels, rank_offset, local_seq))

    def both_at(b: int) -> Any:
        if inputs.head_input is not None:  # the layers reshape what the embedding gives: the two apart
            return embed_at(b), head_at(b)
        ids, labels = inputs.make(b)
        return head(embedding(ids), inputs.labels_of(labels, rank_offset, local_seq))

    def slope(run: Any) -> int:
        return saved_bytes(lambda: run(2)) - saved_bytes(lambda: run(1))

    per_parameter = STATE_BYTES_PER_PARAMETER[dtype]
    emb = _unique_elements(embedding) * per_parameter
    head_full = _unique_elements(head) * per_parameter
    tied_elements = sum(head.get_parameter(n).numel() for n in tied)
    # the head's copy of a tied weight on its own stage: its weight and gradient, master and moments the embedding's
    head_bytes = head_full - (per_parameter - copy_bytes_per_parameter(dtype)) * tied_elements
    return {
        "pp_off": (emb + head_full - per_parameter * tied_elements, slope(both_at)),
        "pp_first": (emb, slope(embed_at)),
        "pp_last": (head_bytes, slope(head_at)),
    }


def _rank_worker(
    rank: int, world_size: int, layered: Any, inputs: VocabInputs, hidden: int, dtype: torch.dtype, megatron_sp: bool
) -> tuple[dict[str, tuple[int, int]], dict[str, VocabForm]]:
    """This rank's bytes per position in the vocabulary-parallel form, and what the forms cost beyond the plain
    modules (:func:`galva_profiler.vocab_forms.measure_forms`)."""
    import torch.distributed as dist

    from galva_hp.model import ParallelContext
    from galva_profiler.vocab_forms import measure_forms

    plain_embedding, plain_head = copy.deepcopy(layered.embedding), copy.deepcopy(layered.head)
    ctx = ParallelContext(tp_group=dist.group.WORLD, megatron_sp=megatron_sp)
    embedding = layered.parallelizer.embedding(layered.embedding, ctx)
    head = layered.parallelizer.head(layered.head, ctx)
    local_seq = inputs.head_seq // world_size if megatron_sp else inputs.head_seq
    offset = rank * local_seq if megatron_sp else 0
    sizes = _position_bytes(embedding, head, inputs, local_seq, hidden, dtype, offset, _tied(layered))
    head_hidden = hidden if inputs.head_input is None else inputs.head_input[1]

    def head_input(batch: int, seq: int) -> tuple[Tensor, Tensor]:
        hidden_in = torch.randn(batch, seq, head_hidden, dtype=dtype, requires_grad=True)
        _, labels = inputs.make(batch)
        return hidden_in, inputs.labels_of(labels, offset if seq < inputs.head_seq else 0, seq)

    forms = measure_forms(
        plain_embedding, plain_head, embedding, head, lambda b: inputs.make(b)[0], head_input,
        (inputs.head_seq, local_seq), dist.group.WORLD, dtype,
    )  # fmt: skip
    return sizes, forms


def vocab_memory(
    layered: Any,
    inputs: VocabInputs,
    hidden: int,
    dtype: torch.dtype,
    degrees: list[int],
    megatron_sp: bool,
    timeout_s: float = 300.0,
) -> VocabMeasurement:
    """Model states and activation bytes per sample of each position, at degree 1 and each of ``degrees`` (forked
    ranks, on CPU: saved bytes do not depend on the device), and there what the parallel forms cost beyond the plain
    modules (``forms``); no times."""
    from galva_comm.testing import run_distributed
    from galva_profiler.vocab_forms import slowest

    result = VocabMeasurement()
    tied = _tied(layered)
    per_degree = {1: _position_bytes(layered.embedding, layered.head, inputs, inputs.head_seq, hidden, dtype, 0, tied)}
    for degree in degrees:
        if degree > 1:
            ranks = run_distributed(
                _rank_worker, degree, layered, inputs, hidden, dtype, megatron_sp, timeout=timeout_s
            )
            per_degree[degree] = {
                position: (max(r[0][position][0] for r in ranks), max(r[0][position][1] for r in ranks))
                for position in POSITIONS
            }
            for name, form in slowest([r[1] for r in ranks]).items():
                result.forms.setdefault(name, {})[degree] = form
    for position in POSITIONS:
        result.model_states_mib[position] = {k: v[position][0] / MIB for k, v in per_degree.items()}
        result.activation_mib_per_sample[position] = {k: v[position][1] / MIB for k, v in per_degree.items()}
    return result


def vocab_times(
    layered: Any,
    inputs: VocabInputs,
    dtype: torch.dtype,
    batches: list[int],
    repeats: Repeats,
    span_s: float = 0.0,
    device: torch.device | None = None,
) -> dict[int, PassTimes]:
    """The embedding and the head's loss at tp 1 over ``batches``, round robin as the layers' (timed rounds spanning
    ``span_s`` seconds at least), on ``device`` (CPU by default: the modules go there for the timing and come back)."""
    device = device or torch.device("cpu")
    forwards = {}
    for batch in batches:
        ids, labels = (t.to(device) for t in inputs.make(batch))
        between = None
        if inputs.head_input is not None:
            between = torch.randn(batch, *inputs.head_input, dtype=dtype, device=device)

        def forward(ids: Tensor = ids, labels: Tensor = labels, between: Tensor | None = between) -> Tensor:
            embedded = layered.embedding(ids)
            if between is not None:  # the head reads the last layer's shape: its input stands in, tied to the graph
                embedded = between + 0.0 * embedded.sum()
            loss_sum, _ = layered.head(embedded, labels)
            return loss_sum

        forwards[batch] = forward
    with on_device(device, layered.embedding, layered.head):
        return time_interleaved(forwards, repeats, device, span_s=span_s)


def measure_vocab(
    layered: Any,
    inputs: VocabInputs,
    hidden: int,
    dtype: torch.dtype,
    batches: list[int],
    degrees: list[int],
    megatron_sp: bool,
    repeats: Repeats,
    timeout_s: float = 300.0,
    span_s: float = 0.0,
) -> VocabMeasurement:
    """:func:`vocab_memory` and :func:`vocab_times` on CPU."""
    result = vocab_memory(layered, inputs, hidden, dtype, degrees, megatron_sp, timeout_s)
    result.times = vocab_times(layered, inputs, dtype, batches, repeats, span_s)
    return result
