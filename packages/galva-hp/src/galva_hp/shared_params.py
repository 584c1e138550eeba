"""Parameters read by several Galva modules: the embedding-to-head tie, T5's relative-position tables, any other.

A model declares each one once, as a :class:`SharedWeight`: the modules that read it (``users``) and its *home*, the
first of them, whose single-process module registers it at ``path`` (so initialisation, checkpoint names and the
single-process oracle see an ordinary parameter, saved once). The runtime (:class:`SharedParameters`) gives it one
set of optimizer states (the home stage's), one gradient sum and one refresh, wherever its readers run. A reader
reads it in one of two ways, which fix where this rank's copy lives:

- **held in place** (``held``: every other user holds it as its own parameter at its own path, e.g. the head's
  ``lm_head.weight``, Hugging Face's tie): each holder's parallel form treats it as any parameter (vocabulary tp
  splits it, the module's data-parallel unit reduces and shards it). On one stage the users read ONE tensor, the
  first user's (the others' forms borrow it before every forward: one weight, one gradient, no copy; a ZeRO-3 home
  keeps it gathered between the readers' forwards, as ZeRO-2 does). Across stages each stage's first user holds its
  own copy of the same form; the copies off the home stage are not the optimizer's.
- **read through** :meth:`SharedWeight.value` (no ``held``; a layer that reads another layer's table): the runtime
  takes it out of its home module before data parallelism wraps it (ZeRO-3 never shards it, ddp never reduces it
  with the layer) and gives every rank whose stage runs a reader one fp32 copy, read by all of that rank's readers.

Per iteration, whichever way it is read:

- each copy's gradient is this rank's share (autograd already summed the readers on its stage);
  :meth:`SharedParameters.reduce_grads` sums the shares over the copies that hold the same piece (every rank of the
  readers' stages for a read-through copy; the rank at the same place of each holder stage for one held in place,
  whose data-parallel unit has summed its replicas), so each copy ends with the full gradient;
- the home stage's copies are stepped (one optimizer record per rank, counted once in the global norm); then the home
  stage broadcasts the new value to the other copies (:meth:`SharedParameters.sync`), which is also how a copy on
  another stage gets its first value.

So placement is free: the readers may sit on any stages, under any tp layout and data-parallel type. The one duty of
a parallel form that reads through ``value()`` is that the shares add up: a form that splits the work over a group
(heads over tp or Ulysses, tokens over Megatron-SP, samples over dp) slices what it uses, and a form that computes
the same thing on every rank of a group reads ``value(replicated_over=group)``, which keeps the gradient on the
group's first rank only. Holders in place must take the same form on every stage (the vocabulary layouts do).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_comm.groups import ProcessGroupCache
from galva_comm.layout import RankLayout, stage_ranks
from galva_hp.activation_checkpoint import unwrapped_name
from galva_hp.data_parallel import DataParallelUnit, ParamRecord, local_tensor
from galva_hp.parallel.mappings import group_rank, group_size
from galva_schema import Strategy
from galva_schema.vocabulary import EMBEDDING_MODULE, HEAD_MODULE, layer_module, layer_of_module

__all__ = ["SharedParameters", "SharedWeight", "embedding_ties", "module_order"]


def module_order(name: str) -> float:
    """Where a Galva module comes in the model: the embedding, ``layers.0`` ... ``layers.{n-1}``, the head."""
    index = layer_of_module(name)
    if index is not None:
        return float(index)
    if name == EMBEDDING_MODULE:
        return -1.0
    if name == HEAD_MODULE:
        return float("inf")
    raise ValueError(f"{name!r} is not a Galva module name (embedding, layers.<i>, head)")


def _module(name: int | str) -> str:
    return layer_module(name) if isinstance(name, int) else name


class SharedWeight:
    """A parameter read by several Galva modules (see the module docstring). ``param`` is registered in module
    ``home`` at ``path``; ``users``: every module that reads it (``home`` included; a layer index stands for
    ``layers.<i>``); ``held``: the other users' paths where each holds it as its own parameter (all of them or
    none). Not a module: readers hold it as a plain attribute."""

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        home: int | str,
        path: str,
        users: Sequence[int | str],
        held: Mapping[str, str] | None = None,
    ) -> None:
        self.name, self.param, self.home, self.path = name, param, _module(home), path
        self.users = tuple(sorted({_module(u) for u in users}, key=module_order))
        self.held = dict(held or {})
        if self.home not in self.users:
            raise ValueError(f"shared parameter {name!r}: its home {self.home} is not one of its users {self.users}")
        if self.held and (set(self.held) | {self.home} != set(self.users) or self.home != self.users[0]):
            raise ValueError(
                f"shared parameter {name!r}: held in place, every user but the home (the first, {self.users[0]}) "
                f"names its path; got home {self.home} and paths for {sorted(self.held)}"
            )
        self._bound: nn.Parameter | None = None  # this rank's read-through copy, once built
        self._dtype: torch.dtype | None = None  # compute dtype, when it differs from the copy's

    @property
    def in_place(self) -> bool:
        """Every user holds it as its own parameter (rather than reading :meth:`value`)."""
        return bool(self.held)

    @property
    def record_name(self) -> str:
        """The name of the parameter in the model's state (``<home>.<path>``)."""
        return f"{self.home}.{self.path}"

    def path_in(self, module: str) -> str:
        """Its path in user ``module`` (held in place), or in the home."""
        return self.path if module == self.home else self.held[module]

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


def embedding_ties(embedding: nn.Module, head: nn.Module) -> list[SharedWeight]:
    """The weights ``head`` holds as the very tensors of ``embedding`` (Hugging Face's tie), each declared once: at
    home in the embedding, held in place by the head."""
    found: dict[int, str] = {}
    for name, param in embedding.named_parameters(remove_duplicate=False):
        found.setdefault(id(param), name)
    out = []
    for head_path, param in head.named_parameters(remove_duplicate=False):
        path = found.get(id(param))
        if path is not None:
            users = (EMBEDDING_MODULE, HEAD_MODULE)
            out.append(SharedWeight(f"tied {path}", param, EMBEDDING_MODULE, path, users, {HEAD_MODULE: head_path}))
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
    group: ProcessGroup | None  # the copies holding the same piece (None: this rank's alone)
    src: int  # global rank that broadcasts the value: the home stage's
    home_ranks: int  # read-through: ranks of the home stage (each hands an identical copy to the optimizer)
    at_home: bool  # this rank is on the home stage
    holder: str  # the first user on this rank's stage: in place, the module whose parameter is this rank's copy
    borrowers: tuple[str, ...]  # in place: the other users on this stage, which read the holder's tensor
    remote: bool  # some copy is on another stage than the home: sync broadcasts
    copy: nn.Parameter | None = None  # this rank's copy (held in place: the holder unit's master, set by hold())
    shapes: dict[str, torch.Size] = field(default_factory=dict)  # a borrower's own form of it, before release()


class SharedParameters(nn.Module):
    """This rank's copies of the shared parameters its stage reads, and their per-iteration duties."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = nn.ParameterDict()  # read-through name -> this rank's fp32 copy
        self._entries: list[_Entry] = []
        self._held: dict[str, nn.Module] = {}  # module name -> its built form, once held

    @staticmethod
    def _stage(strategy: Strategy, module: str) -> int:
        index = layer_of_module(module)
        if index is not None:
            return strategy.layer_stages[index]
        return 0 if module == EMBEDDING_MODULE else strategy.pp - 1

    @classmethod
    def _groups(cls, weight: SharedWeight, strategy: Strategy, layout: RankLayout) -> list[tuple[int, ...]]:
        """The groups whose copies are summed: all holders (read through), or one per place in a stage (in place)."""
        stages = sorted({cls._stage(strategy, u) for u in weight.users})
        per_stage = [stage_ranks(layout.world_size, strategy.pp, s) for s in stages]
        if not weight.in_place:
            return [tuple(r for ranks in per_stage for r in ranks)]
        return [tuple(ranks[i] for ranks in per_stage) for i in range(len(per_stage[0]))]

    @classmethod
    def create_groups(
        cls, weights: Sequence[SharedWeight], strategy: Strategy, layout: RankLayout, groups: ProcessGroupCache
    ) -> None:
        """Create the copies' groups (collective: every rank calls it with the same model and plan)."""
        groups.create([g for w in weights for g in cls._groups(w, strategy, layout) if len(g) > 1])

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
        """An entry for every shared parameter this rank's stage reads; a read-through one gets its copy now, bound
        into its :class:`SharedWeight` (the home stage's from the home value, the others filled by :meth:`sync`), one
        held in place when its holder is wrapped (:meth:`hold`)."""
        out = cls()
        stage = layout.stage_of(rank)
        for weight in weights:
            group = next((g for g in cls._groups(weight, strategy, layout) if rank in g), None)
            if group is None:
                continue
            here = [u for u in weight.users if cls._stage(strategy, u) == stage]
            home_stage = cls._stage(strategy, weight.home)
            home = stage_ranks(layout.world_size, strategy.pp, home_stage)
            entry = _Entry(
                weight=weight,
                group=groups.get(group) if len(group) > 1 else None,
                src=next(r for r in group if r in home),
                home_ranks=len(home),
                at_home=home_stage == stage,
                holder=here[0],
                borrowers=tuple(here[1:]) if weight.in_place else (),
                remote=len({cls._stage(strategy, u) for u in weight.users}) > 1,
            )
            if not weight.in_place:
                source = weight.param.detach()
                value = torch.zeros(source.shape, device=device) if source.is_meta else source.float().clone()
                entry.copy = nn.Parameter(value.to(device), requires_grad=weight.param.requires_grad)
                out.copies[_key(weight)] = entry.copy
                weight.bind(entry.copy, dtype)
            out._entries.append(entry)
        return out

    def capture(self, module: str, single: nn.Module) -> None:
        """Module ``module``'s single-process form, materialised for its conversion: the home stage's read-through
        copies whose home it is take their first value from it (needed when the model is on meta)."""
        for entry in self._entries:
            weight = entry.weight
            if not weight.in_place and weight.home == module and entry.at_home and entry.copy is not None:
                source = single.get_parameter(weight.path).detach()
                if not source.is_meta:
                    with torch.no_grad():
                        entry.copy.copy_(source.float())

    def lends(self, module: str) -> bool:
        """Whether another module on this rank reads a parameter ``module`` holds in place (its data-parallel unit
        must then keep it gathered from its forward until its backward: ZeRO-2, not ZeRO-3)."""
        return any(e.holder == module and e.borrowers for e in self._entries)

    def release(self, module: str, form: nn.Module) -> None:
        """Module ``module``'s parallel form, before data parallelism wraps it: drop every read-through parameter
        whose home it is (read through its :class:`SharedWeight`) and every one it borrows from a holder on this
        rank (bound again by :meth:`hold`)."""
        for entry in self._entries:
            weight = entry.weight
            if not weight.in_place and weight.home == module:
                _unregister(form, weight.path)
            elif module in entry.borrowers:
                path = weight.path_in(module)
                try:
                    entry.shapes[module] = form.get_parameter(path).shape
                except AttributeError:
                    message = f"shared {weight.name!r}: no parameter {module}.{path} in its parallel form"
                    raise ValueError(message) from None
                _unregister(form, path)

    def hold(self, module: str, unit: DataParallelUnit) -> None:
        """Module ``module`` wrapped as ``unit``: its master of every parameter it holds in place becomes this rank's
        copy, and every one it borrows reads its holder's tensor (bound again before each forward: a ZeRO holder
        swaps its sharded and gathered parameters)."""
        self._held[module] = unit.module
        masters = {unwrapped_name(n): p for n, p in unit.master_parameters()}
        for entry in self._entries:
            weight = entry.weight
            if not weight.in_place:
                continue
            if entry.holder == module:
                path = weight.path_in(module)
                if path not in masters:
                    raise ValueError(f"shared {weight.name!r}: no parameter {module}.{path} in its parallel form")
                entry.copy = masters[path]
            elif module in entry.borrowers:
                unit.exclude = unit.exclude | {weight.path_in(module)}  # the holder's unit's, not this one's
                self._lend(entry, module, unit.module)

    def _lend(self, entry: _Entry, module: str, form: nn.Module) -> None:
        weight, holder = entry.weight, self._held[entry.holder]
        source, target = weight.path_in(entry.holder), weight.path_in(module)
        if holder.get_parameter(source).shape != entry.shapes[module]:
            raise ValueError(
                f"shared {weight.name!r}: {module}'s form holds it as {tuple(entry.shapes[module])}, "
                f"{entry.holder}'s as {tuple(holder.get_parameter(source).shape)}: the holders' forms must agree"
            )
        owner_path, _, attr = target.rpartition(".")
        owner = form.get_submodule(owner_path) if owner_path else form

        def bind(*_: Any) -> None:
            owner._parameters[attr] = holder.get_parameter(source)

        bind()
        form.register_forward_pre_hook(bind)

    def followers(self) -> set[int]:
        """Ids of the copies held in place off the home stage: given the home value, never the optimizer's."""
        return {id(e.copy) for e in self._entries if e.weight.in_place and not e.at_home and e.copy is not None}

    def reduce_grads(self) -> None:
        """Sum every copy's gradient over its group (after the schedule and the data-parallel reductions); the
        copies off the home stage then drop theirs (the optimizer does not see them)."""
        for entry in self._entries:
            copy = entry.copy
            if copy is None or not copy.requires_grad:
                continue
            if copy.grad is None:
                copy.grad = torch.zeros_like(copy)
            if entry.group is not None:
                dist.all_reduce(local_tensor(copy.grad), group=entry.group)
            if not entry.at_home:
                copy.grad = None

    def records(self) -> list[ParamRecord]:
        """The optimizer's records of the read-through copies on the home stage, each counted once over the world
        in the global norm (a copy held in place is its data-parallel unit's record)."""
        return [
            ParamRecord(name=e.weight.record_name, param=e.copy, replicas=e.home_ranks)
            for e in self._entries
            if not e.weight.in_place and e.at_home and e.copy is not None and e.copy.requires_grad
        ]

    def sync(self) -> None:
        """Give the copies off the home stage the home value (after every optimizer step, a load, and the build)."""
        with torch.no_grad():
            for entry in self._entries:
                if entry.remote and entry.group is not None and entry.copy is not None:
                    dist.broadcast(local_tensor(entry.copy.data), src=entry.src, group=entry.group)


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
