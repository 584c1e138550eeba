"""Parameters shared between layers (other than the embedding-to-head tie): T5's relative-position tables, any tie.

A model declares each shared parameter as a :class:`SharedWeight`: a name, the layers that read it, and its *home*,
the first of them, whose single-process module registers it (at ``path``, under its usual name, so initialisation,
checkpoint names and the single-process oracle see an ordinary parameter). Every layer, home or not, reads it through
:meth:`SharedWeight.value`, never through its own attribute.

At build time the runtime (:class:`SharedParameters`) takes the parameter out of its home module before data
parallelism wraps it, so ZeRO-3 never shards it and ddp never reduces it with the layer, and gives every rank whose
stage runs a reader one fp32 copy, read by all of that rank's readers. Then, per iteration:

- each rank's gradient of its copy is its own share (its data; the heads or tokens it computes; autograd already
  summed the readers on its stage); :meth:`SharedParameters.reduce_grads` sums the shares over the *holders*, every
  rank of every stage that runs a reader, so each copy ends with the full gradient;
- the ranks of the home stage hand their copy to the optimizer (one record per rank, counted once in the global
  norm); after the step, the home stage's first rank broadcasts the new value to the other holders
  (:meth:`SharedParameters.sync`), which is also how a copy on another stage gets its first value.

So placement is free: the readers may sit on any stages, under any tp layout and data-parallel type. The one duty of
a parallel form is that the shares add up: a form that splits the work over a group (heads over tp or Ulysses,
tokens over Megatron-SP, samples over dp) slices what it uses, and a form that computes the same thing on every rank
of a group reads ``value(replicated_over=group)``, which keeps the gradient on the group's first rank only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_comm.groups import ProcessGroupCache
from galva_comm.layout import RankLayout
from galva_hp.data_parallel import ParamRecord
from galva_hp.parallel.mappings import group_rank, group_size
from galva_schema import Strategy
from galva_schema.vocabulary import layer_module

__all__ = ["SharedParameters", "SharedWeight"]


class SharedWeight:
    """A parameter read by several layers. ``param`` is registered in layer ``home`` at ``path``; ``users`` are the
    indices of every layer that reads it (``home`` included). Not a module: layers hold it as a plain attribute."""

    def __init__(self, name: str, param: nn.Parameter, home: int, path: str, users: Sequence[int]) -> None:
        self.name, self.param, self.home, self.path = name, param, home, path
        self.users = tuple(sorted(set(users)))
        if home not in self.users:
            raise ValueError(f"shared parameter {name!r}: its home layer {home} is not one of its users {self.users}")
        self._bound: nn.Parameter | None = None  # this rank's copy, once built
        self._dtype: torch.dtype | None = None  # compute dtype, when it differs from the copy's

    @property
    def record_name(self) -> str:
        """The name of the parameter in the model's state (``layers.<home>.<path>``)."""
        return f"{layer_module(self.home)}.{self.path}"

    def bind(self, copy: nn.Parameter, dtype: torch.dtype | None) -> None:
        """Read ``copy`` (cast to ``dtype`` if given) from now on (the runtime calls this)."""
        self._bound, self._dtype = copy, dtype

    def value(self, replicated_over: ProcessGroup | None = None) -> Tensor:
        """The parameter as the layers compute with it. ``replicated_over``: a group every rank of which computes
        the same thing with it; only the group's first rank then keeps a gradient (see the module docstring)."""
        param = self.param if self._bound is None else self._bound
        out = param if self._dtype is None or param.dtype == self._dtype else param.to(self._dtype)
        if group_size(replicated_over) > 1 and torch.is_grad_enabled():
            out = _GradOnFirstRank.apply(out, replicated_over)
        return out


class _GradOnFirstRank(torch.autograd.Function):
    """Forward identity; backward keeps the gradient on the group's first rank and zero elsewhere (exact)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.first = group_rank(group) == 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return (grad if ctx.first else torch.zeros_like(grad)), None


@dataclass
class _Entry:
    weight: SharedWeight
    copy: nn.Parameter
    group: ProcessGroup | None  # the holders (None: this rank alone)
    src: int  # global rank that broadcasts the value: the home stage's first rank
    home_ranks: int  # ranks of the home stage (each hands an identical copy to the optimizer)
    at_home: bool  # this rank is on the home stage
    remote: bool  # some holder is on another stage than the home


class SharedParameters(nn.Module):
    """This rank's copies of the shared parameters its stage reads, and their per-iteration duties."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = nn.ParameterDict()  # shared name -> this rank's fp32 copy
        self._entries: list[_Entry] = []

    @staticmethod
    def create_groups(
        weights: Sequence[SharedWeight], strategy: Strategy, layout: RankLayout, groups: ProcessGroupCache
    ) -> None:
        """Create the holders' groups (collective: every rank calls it with the same model and plan)."""
        groups.create([r for w in weights if len(r := layout.layer_holders(w.users)) > 1])

    @classmethod
    def for_stage(
        cls,
        weights: Sequence[SharedWeight],
        strategy: Strategy,
        layout: RankLayout,
        groups: ProcessGroupCache,
        rank: int,
        dtype: torch.dtype | None,
        device: str | torch.device,
    ) -> SharedParameters:
        """A copy of every shared parameter that this rank's stage reads, bound into its :class:`SharedWeight`.
        The copy on the home stage starts from the home value; the others are filled by :meth:`sync`."""
        out = cls()
        stage = layout.stage_of(rank)
        for weight in weights:
            holders = layout.layer_holders(weight.users)
            if rank not in holders:
                continue
            home = layout.layer_holders([weight.home])
            source = weight.param.detach()
            value = torch.zeros(source.shape, device=device) if source.is_meta else source.float().clone()
            copy = nn.Parameter(value.to(device), requires_grad=weight.param.requires_grad)
            out.copies[_key(weight)] = copy
            weight.bind(copy, dtype)
            out._entries.append(
                _Entry(
                    weight=weight,
                    copy=copy,
                    group=groups.get(holders) if len(holders) > 1 else None,
                    src=home[0],
                    home_ranks=len(home),
                    at_home=strategy.layer_stages[weight.home] == stage,
                    remote=len(holders) > len(home),
                )
            )
        return out

    def capture(self, index: int, single: nn.Module) -> None:
        """Layer ``index``'s single-process module, materialised for its conversion: the home stage's copies of the
        shared parameters whose home it is take their first value from it (needed when the model is on meta)."""
        for entry in self._entries:
            if entry.weight.home == index and entry.at_home:
                source = single.get_parameter(entry.weight.path).detach()
                if not source.is_meta:
                    with torch.no_grad():
                        entry.copy.copy_(source.float())

    def release(self, index: int, module: nn.Module) -> None:
        """Layer ``index``'s parallel form ``module``: drop every shared parameter whose home it is from it (it is read
        through its :class:`SharedWeight`), before data parallelism wraps the module."""
        for entry in self._entries:
            if entry.weight.home == index:
                _unregister(module, entry.weight.path)

    def reduce_grads(self) -> None:
        """Sum every copy's gradient over its holders (after the schedule); the copies off the home stage then drop
        theirs (the optimizer does not see them)."""
        for entry in self._entries:
            copy = entry.copy
            if not copy.requires_grad:
                continue
            if copy.grad is None:
                copy.grad = torch.zeros_like(copy)
            if entry.group is not None:
                dist.all_reduce(copy.grad, group=entry.group)
            if not entry.at_home:
                copy.grad = None

    def records(self) -> list[ParamRecord]:
        """The optimizer's records: the home stage's copies, each counted once over the world in the global norm."""
        return [
            ParamRecord(name=e.weight.record_name, param=e.copy, replicas=e.home_ranks)
            for e in self._entries
            if e.at_home and e.copy.requires_grad
        ]

    def sync(self) -> None:
        """Give the holders off the home stage the home value (after every optimizer step, a load, and the build)."""
        with torch.no_grad():
            for entry in self._entries:
                if entry.remote and entry.group is not None:
                    dist.broadcast(entry.copy.data, src=entry.src, group=entry.group)


def _key(weight: SharedWeight) -> str:
    return weight.record_name.replace(".", "_")


def _unregister(module: nn.Module, path: str) -> None:
    """Drop the parameter at ``path`` from ``module`` if a parallel form kept it (tp 1 keeps the layer as it is)."""
    owner_path, _, attr = path.rpartition(".")
    try:
        owner = module.get_submodule(owner_path) if owner_path else module
    except AttributeError:
        return
    if isinstance(owner._parameters.get(attr), nn.Parameter):
        owner.register_parameter(attr, None)
