"""Which ranks form each layer's groups. Pure Python: no torch, usable by the planner and the runtime alike.

Conventions (same as the reference system, so its strategy files mean the same thing here):

- Pipeline stages are the outermost axis. With ``R = world_size // pp`` ranks per stage, stage ``s`` owns the
  contiguous block ``[s*R, (s+1)*R)``; the *local rank* of a global rank is its index inside that block.
- A layer of model-parallel degree ``t`` (Megatron tp, or Ulysses sp) splits its stage into ``R/t`` model-parallel
  groups and ``t`` data-parallel groups:
  * consecutive: model-parallel groups are blocks of ``t`` consecutive local ranks; data-parallel groups are the
    local ranks strided by ``t``.
  * strided: model-parallel groups are local ranks strided by ``R/t``; data-parallel groups are blocks of ``R/t``.
- Context parallelism of degree ``c`` cuts each such data-parallel group (in its order) into blocks of ``c``
  consecutive members, the context-parallel groups (rings); the data-parallel groups proper are its members
  strided by ``c``.
- The *sharding group* (where ZeRO-2/3 shards states and gradients are reduced) is the data-parallel group times
  the context-parallel group for Megatron layers, and the whole stage (``dp * cp * sp`` ranks) for Ulysses
  layers, whose weights are replicated over the sequence-parallel group.
- Pipeline groups are ``{i, i+R, i+2R, ...}``; the embedding-tying group of a pipeline is its first and last rank.
- Experts (Megatron's order): a layer's stage, as ``R = edp x ep x etp`` local ranks, etp fastest: expert
  tensor-parallel groups are blocks of ``etp`` consecutive local ranks, expert-parallel groups are local ranks
  strided by ``etp`` inside blocks of ``ep x etp``, expert data-parallel groups are local ranks strided by
  ``ep x etp``. The whole-stage group (all ``R`` ranks) sums a micro-batch's router statistics.

Every group is a tuple of global ranks in ascending order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING

from galva_comm.shards import Group, RedistributionPlan, ShardLayout, check_divides, redistribution_plan
from galva_schema.vocabulary import GroupKind

if TYPE_CHECKING:  # only annotated here: a planner's layout questions load no pydantic model (galva-search --help)
    from galva_schema import Strategy


def stage_ranks(world_size: int, pp: int, stage: int) -> Group:
    """Global ranks of pipeline stage ``stage``."""
    check_divides(pp, world_size, "pp", "world_size")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} out of range for pp={pp}")
    per_stage = world_size // pp
    return tuple(range(stage * per_stage, (stage + 1) * per_stage))


def pipeline_groups(world_size: int, pp: int) -> list[Group]:
    """The ``R`` pipelines: local rank ``i`` of every stage, in stage order."""
    check_divides(pp, world_size, "pp", "world_size")
    per_stage = world_size // pp
    return [tuple(i + s * per_stage for s in range(pp)) for i in range(per_stage)]


def embedding_tie_groups(world_size: int, pp: int) -> list[Group]:
    """First and last rank of every pipeline (to keep tied embedding/head weights equal); empty when pp == 1."""
    if pp == 1:
        return []
    return [(group[0], group[-1]) for group in pipeline_groups(world_size, pp)]


def model_parallel_groups(ranks: Group, degree: int, consecutive: bool = True) -> list[Group]:
    """Split a stage's ranks into groups of ``degree`` ranks (tensor- or Ulysses-parallel groups)."""
    check_divides(degree, len(ranks), "degree", "ranks per stage")
    count = len(ranks) // degree
    if consecutive:
        return [tuple(ranks[g * degree + j] for j in range(degree)) for g in range(count)]
    return [tuple(ranks[g + j * count] for j in range(degree)) for g in range(count)]


def data_parallel_groups(ranks: Group, degree: int, consecutive: bool = True) -> list[Group]:
    """The complement of :func:`model_parallel_groups`: ranks holding the same model shard."""
    check_divides(degree, len(ranks), "degree", "ranks per stage")
    count = len(ranks) // degree
    if consecutive:
        return [tuple(ranks[g * degree + j] for g in range(count)) for j in range(degree)]
    return [tuple(ranks[j * count + g] for g in range(count)) for j in range(degree)]


# ------------------------------------------------------------------------------------------------ per-strategy view
@dataclass(frozen=True)
class LayerGroups:
    """All groups of one layer (or of the vocabulary layers at one stage). Each list partitions the stage."""

    stage: int
    tp: list[Group]  # Megatron tensor-parallel groups (singletons for Ulysses or tp=1 layers)
    sp: list[Group]  # Ulysses groups (singletons for Megatron layers)
    cp: list[Group]  # context-parallel groups: the ring of ranks holding other chunks of the same samples
    dp: list[Group]  # data-parallel groups: ranks that see different samples with the same model shard
    shard: list[Group]  # where ZeRO shards and gradients are reduced: dp x cp, and x sp for Ulysses
    activation: ShardLayout
    ep: list[Group]  # expert-parallel groups (singletons for ep = 1)
    etp: list[Group]  # expert tensor-parallel groups (singletons for etp = 1)
    edp: list[Group]  # expert data-parallel groups: the same expert shard, where its gradients are reduced
    whole: list[Group]  # the whole stage

    @property
    def ranks(self) -> Group:
        """Global ranks of the stage these groups live on."""
        return self.activation.ranks

    def of(self, kind: GroupKind, rank: int) -> Group:
        """The group of ``kind`` that contains ``rank``."""
        for group in getattr(self, GroupKind(kind).value):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is not in stage {self.stage}")


def expert_groups(ranks: Group, ep: int, etp: int) -> tuple[list[Group], list[Group], list[Group]]:
    """``(ep, etp, edp)`` groups of a stage's ranks (see the module docstring)."""
    check_divides(ep * etp, len(ranks), "ep x etp", "ranks per stage")
    block = ep * etp
    edp = len(ranks) // block
    etp_groups = [tuple(ranks[g * etp + j] for j in range(etp)) for g in range(len(ranks) // etp)]
    ep_groups = [tuple(ranks[d * block + e * etp + t] for e in range(ep)) for d in range(edp) for t in range(etp)]
    edp_groups = [tuple(ranks[d * block + i] for d in range(edp)) for i in range(block)]
    return ep_groups, etp_groups, edp_groups


def _groups(
    ranks: Group,
    stage: int,
    degree: int,
    consecutive: bool,
    ulysses: bool,
    seq_parts: int,
    cp: int = 1,
    ep: int = 1,
    etp: int = 1,
) -> LayerGroups:
    mp = model_parallel_groups(ranks, degree, consecutive)
    rest = data_parallel_groups(ranks, degree, consecutive)  # in order of g = dp index * cp + cp index
    check_divides(cp, len(rest[0]), "cp", "ranks per model-parallel index")
    singles: list[Group] = [(r,) for r in ranks]
    ep_groups, etp_groups, edp_groups = expert_groups(ranks, ep, etp)
    return LayerGroups(
        stage=stage,
        tp=singles if ulysses else mp,
        sp=mp if ulysses else singles,
        cp=[tuple(sorted(g[i : i + cp])) for g in rest for i in range(0, len(g), cp)],
        dp=[tuple(sorted(g[i::cp])) for g in rest for i in range(cp)],
        shard=[ranks] if ulysses else rest,
        activation=ShardLayout(ranks, degree, consecutive, seq_sharded=seq_parts > 1, cp=cp),
        ep=ep_groups,
        etp=etp_groups,
        edp=edp_groups,
        whole=[ranks],
    )


class RankLayout:
    """Every group a :class:`~galva_schema.Strategy` needs, for every rank, in one deterministic order."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.world_size = strategy.world_size
        self.pp = strategy.pp
        stages = strategy.layer_stages
        self.layers: list[LayerGroups] = []
        for index, layer in enumerate(strategy.layers):
            ranks = stage_ranks(self.world_size, self.pp, stages[index])
            consecutive = tp_consecutive(layer.tp, len(ranks), layer.tp_consecutive)
            seq_parts = strategy.layer_sequence_shards(index)
            self.layers.append(
                _groups(
                    ranks, stages[index], layer.tp, consecutive, layer.ulysses, seq_parts,
                    cp=layer.cp, ep=layer.ep, etp=layer.etp,
                )
            )
        vocab, vocab_parts = strategy.vocab, strategy.vocab_sequence_shards
        first_ranks = stage_ranks(self.world_size, self.pp, 0)
        self.vocab_first = _groups(first_ranks, 0, vocab.tp, True, vocab.sp, vocab_parts, vocab.cp)
        last = self.pp - 1
        self.vocab_last = _groups(
            stage_ranks(self.world_size, self.pp, last), last, vocab.tp, True, vocab.sp, vocab_parts, vocab.cp
        )
        self.pipelines = pipeline_groups(self.world_size, self.pp)
        self.embedding_ties = embedding_tie_groups(self.world_size, self.pp)

    def stage_of(self, rank: int) -> int:
        return rank // self.strategy.ranks_per_stage

    def layer_holders(self, layers: Iterable[int]) -> Group:
        """Every rank of every stage that runs one of ``layers``: the holders of a parameter those layers share."""
        stages = {self.strategy.layer_stages[i] for i in layers}
        return tuple(sorted(r for s in stages for r in stage_ranks(self.world_size, self.pp, s)))

    def boundary_plans(self) -> Iterator[tuple[int, RedistributionPlan]]:
        """(layer index, plan) for every layer whose input layout differs from what precedes it on its stage.

        Index 0's predecessor is the embedding; a stage's first layer receives its predecessor's layout through p2p
        (local rank i to local rank i), so the comparison is made on the receiving stage's ranks.
        """
        previous = self.vocab_first.activation
        for index, groups in enumerate(self.layers):
            source = replace(previous, ranks=groups.activation.ranks)
            if source != groups.activation:
                yield index, redistribution_plan(source, groups.activation)
            previous = groups.activation
        tail = self.vocab_last.activation
        source = replace(previous, ranks=tail.ranks)
        if source != tail:
            yield len(self.layers), redistribution_plan(source, tail)

    def all_groups(self, include_singletons: bool = False) -> list[Group]:
        """Every distinct group, in one deterministic order (sorted by size, then ranks).

        All ranks must create process groups in the same order; creating them from this list guarantees it and
        creates one communicator per distinct group however many layers share it.
        """
        found: set[Group] = set()
        for groups in [*self.layers, self.vocab_first, self.vocab_last]:
            kinds = [groups.tp, groups.sp, groups.cp, groups.dp, groups.shard, groups.ep, groups.etp, groups.edp]
            kinds.append(groups.whole)
            for kind in kinds:
                found.update(kind)
        found.update(self.pipelines)
        found.update(self.embedding_ties)
        for _, plan in self.boundary_plans():
            found.update(plan.groups)
            found.update(plan.reverse().groups)  # backward exchanges can connect ranks the forward does not
        return sorted((g for g in found if include_singletons or len(g) > 1), key=lambda g: (len(g), g))


# ------------------------------------------------------------------------------------------------ asked by planners
# A planner prices a layer before any Strategy exists; it asks these instead of restating the conventions above.
def ranks_per_stage(world_size: int, pp: int) -> int:
    """Ranks in one pipeline stage, ``world_size // pp`` (``Strategy.ranks_per_stage`` of a plan not yet written);
    ``ValueError`` when ``pp`` does not divide ``world_size``."""
    check_divides(pp, world_size, "pp", "world_size")
    return world_size // pp


def group_consecutive(degree: int, size: int, consecutive: bool) -> bool:
    """Whether a group of ``degree`` ranks out of ``size`` (a stage's ranks, or the whole world's) is a block of
    consecutive ranks: as ``consecutive`` says, except that a group of one rank or of all ``size`` is the same group
    either way (it has one layout), and counts as consecutive (as :class:`RankLayout` builds it)."""
    return consecutive or degree in (1, size)


def tp_consecutive(degree: int, stage_size: int, consecutive: bool) -> bool:
    """Whether a layer's model-parallel group of ``degree`` ranks, on a stage of ``stage_size`` ranks, is a block of
    consecutive ranks (its ``tp_consecutive`` flag, read by :func:`group_consecutive`)."""
    return group_consecutive(degree, stage_size, consecutive)


@cache
def sharding_group_shape(stage_size: int, degree: int, consecutive: bool, ulysses: bool) -> tuple[int, bool]:
    """``(ranks, consecutive)`` of a layer's sharding group (where its gradients are reduced and ZeRO shards its
    states) on a stage of ``stage_size`` ranks, read off the groups :class:`RankLayout` builds: a Megatron layer's
    data-parallel group (strided when its tp group is a block, a block when its tp group is strided or of one
    rank), a Ulysses layer's whole stage. The vocabulary layers' groups are always consecutive (``consecutive``
    True, ``ulysses`` their ``sp``)."""
    ranks = tuple(range(stage_size))
    groups = _groups(ranks, 0, degree, tp_consecutive(degree, stage_size, consecutive), ulysses, 1)
    group = groups.shard[0]
    return len(group), group == tuple(range(group[0], group[0] + len(group)))
