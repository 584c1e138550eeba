"""How a model is described to galva-hp: an ordered list of modules plus how to make each one parallel.

A model adapter (galva-models for Hugging Face models, :mod:`galva_hp.testing.models` for the tiny test models)
returns a :class:`LayeredModel`. The runtime then keeps this rank's stage, converts every module to its parallel
form with a :class:`ParallelContext` built from the strategy, wraps data parallelism, checkpointing and pipelining
around it, and trains it.

Activations between modules are ``[batch, seq, hidden]`` tensors (batch first). At a layer boundary a rank holds
its data-parallel share of the batch, and the whole sequence, or its ``1/degree`` slice of it when the layer is
sequence-sharded (Megatron-SP with tp > 1, or Ulysses): see :class:`galva_comm.layout.ShardLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from torch import Tensor, nn

from galva_hp.shared_params import SharedWeight
from galva_schema import ModelConstraints
from galva_schema.sharding import sequence_shards
from galva_schema.vocabulary import EMBEDDING_MODULE, HEAD_MODULE, layer_module

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from galva_hp.parallel.balance import BalanceLedger


@dataclass(frozen=True)
class ParallelContext:
    """What a module's parallel form needs to know about its groups.

    ``tp_group`` is the Megatron tensor-parallel group (None when tp == 1), ``sp_group`` the Ulysses group (None
    unless the layer uses Ulysses). With ``megatron_sp`` and tp > 1, activations at the module's boundaries are
    sharded along the sequence over ``tp_group``; a Ulysses layer's boundaries are sharded along the sequence over
    ``sp_group``. ``vocab_sp`` marks vocabulary modules that split the sequence (not the vocabulary) over
    ``sp_group``. ``cp_group`` is the context-parallel ring (None when cp == 1): the module's boundaries hold this
    rank's two chunks of the sequence (:func:`galva_schema.sharding.context_chunks`), which the above may split
    further; ``cp_index`` is this rank's place in it.

    A layer with experts splits them over ``ep_group`` and each expert's FFN over ``etp_group`` (None: degree 1);
    the data-parallel unit of the expert parameters reduces over the layer's expert data-parallel group instead of
    its sharding group. ``ledger`` takes a micro-batch's router statistics where the model's loss has a term over
    all of them (:class:`~galva_hp.parallel.balance.BalanceLedger`; None otherwise).
    """

    tp_group: ProcessGroup | None = None
    sp_group: ProcessGroup | None = None
    megatron_sp: bool = False
    vocab_sp: bool = False
    cp_group: ProcessGroup | None = None
    cp_index: int = 0
    ep_group: ProcessGroup | None = None
    etp_group: ProcessGroup | None = None
    ledger: BalanceLedger | None = None

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_group is None else self.tp_group.size()

    @property
    def sp_size(self) -> int:
        return 1 if self.sp_group is None else self.sp_group.size()

    @property
    def cp_size(self) -> int:
        return 1 if self.cp_group is None else self.cp_group.size()

    @property
    def seq_sharded(self) -> bool:
        """Whether activations at this module's boundaries hold only a slice of the (context-local) sequence of its
        model-parallel group."""
        degree = max(self.tp_size, self.sp_size)
        return sequence_shards(degree, ulysses=self.sp_size > 1, megatron_sp=self.megatron_sp) > 1

    @property
    def sequence_parallel_tp(self) -> bool:
        """Megatron-SP applies here: a tp > 1 module whose boundaries are split along the sequence over ``tp_group``
        (its norms and other replicated parameters then see a sequence shard)."""
        return self.tp_size > 1 and self.seq_sharded


class Parallelizer(Protocol):
    """Turns single-process modules into their parallel form for one rank. Implementations are per model family."""

    def layer(self, module: nn.Module, layer_type: str, ctx: ParallelContext) -> nn.Module:
        """Parallel form of a transformer layer: ``hidden -> hidden`` in the layer's boundary layout."""
        ...

    def embedding(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        """Parallel form of the embedding: ``input_ids [b, s or s/sp] -> hidden`` in the vocab boundary layout."""
        ...

    def head(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        """Parallel form of final norm + head + loss: ``(hidden, labels) -> (loss_sum, token_count)``.

        ``labels`` are this rank's labels in the same batch/sequence share as ``hidden``; ``loss_sum`` is the sum of
        the token losses this rank is responsible for (each token counted on exactly one rank of a tp group, or
        reduced so), so the runtime can divide by the global token count.
        """
        ...


@dataclass
class LayeredModel:
    """A model decomposed into Galva's ordered modules (single-process form, on any device including meta).

    - ``embedding``: ``input_ids [b, s] -> hidden [b, s, h]``
    - ``layers[i]``: ``hidden -> hidden``; ``layer_types[i]`` names its kind (e.g. ``"decoder"``)
    - ``head``: final norm + output projection + loss: ``(hidden, labels) -> (loss_sum, token_count)``
    - ``constraints``: what the model can run (heads, unsupported forms, shared parameters), which
      :func:`galva_hp.build` checks a plan against with :func:`galva_schema.plan_problems`
    - ``shared``: parameters read by several modules (:class:`~galva_hp.shared_params.SharedWeight`), on any
      stages: the embedding-to-head tie (:func:`~galva_hp.shared_params.embedding_ties`), a table several layers read
    - ``router_loss``: ``(experts, coef)`` where the loss adds a load-balancing term over every layer's router
      statistics of a micro-batch (:mod:`galva_hp.parallel.balance`); layers report them to ``ctx.ledger``

    A layer's parallel form marks its expert parameters (``param.galva_expert = True``): they get their own
    data-parallel unit over the layer's expert data-parallel group.
    """

    embedding: nn.Module
    layers: list[nn.Module]
    head: nn.Module
    layer_types: list[str]
    parallelizer: Parallelizer
    name: str = "model"
    constraints: ModelConstraints = field(kw_only=True)
    shared: list[SharedWeight] = field(default_factory=list, kw_only=True)
    router_loss: tuple[int, float] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if len(self.layer_types) != len(self.layers):
            raise ValueError(f"{self.name}: {len(self.layers)} layers but {len(self.layer_types)} layer types")
        declared = [t.name for t in self.constraints.layer_types for _ in range(t.num_layers)]
        if declared != self.layer_types:
            raise ValueError(
                f"{self.name}: constraints declare layer types {declared}, the model has {self.layer_types}"
            )
        modules = dict(self.galva_modules())
        for weight in self.shared:
            for user in weight.users:
                if user not in modules:
                    raise ValueError(f"{self.name}: shared {weight.name!r} names {user}, not a module of the model")
            for user in (weight.home, *weight.held):
                path = weight.path_in(user)
                if _parameter(modules[user], path) is not weight.param:
                    raise ValueError(f"{self.name}: shared {weight.name!r} is not {user}.{path}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def galva_modules(self) -> list[tuple[str, nn.Module]]:
        """(name, module) in model order: ``embedding``, ``layers.0`` ... ``layers.{n-1}``, ``head``, the names
        checkpoints, data-parallel units and plans use (:mod:`galva_schema.vocabulary`)."""
        layers = [(layer_module(i), layer) for i, layer in enumerate(self.layers)]
        return [(EMBEDDING_MODULE, self.embedding), *layers, (HEAD_MODULE, self.head)]

    def reference_loss(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """Mean token loss of the unmodified single-process model: the correctness oracle."""
        hidden = self.embedding(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        loss_sum, count = self.head(hidden, labels)
        return loss_sum / count


def _parameter(module: nn.Module, path: str) -> nn.Parameter | None:
    try:
        return module.get_parameter(path)
    except AttributeError:
        return None
