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
from fractions import Fraction
from functools import cache

from galva_schema import GroupKind, Strategy
from galva_schema.sharding import contiguous_block, sequence_blocks, sequence_cell_count, sequence_cells

Group = tuple[int, ...]


def stage_ranks(world_size: int, pp: int, stage: int) -> Group:
    """Global ranks of pipeline stage ``stage``."""
    _check_divides(pp, world_size, "pp", "world_size")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} out of range for pp={pp}")
    per_stage = world_size // pp
    return tuple(range(stage * per_stage, (stage + 1) * per_stage))


def pipeline_groups(world_size: int, pp: int) -> list[Group]:
    """The ``R`` pipelines: local rank ``i`` of every stage, in stage order."""
    _check_divides(pp, world_size, "pp", "world_size")
    per_stage = world_size // pp
    return [tuple(i + s * per_stage for s in range(pp)) for i in range(per_stage)]


def embedding_tie_groups(world_size: int, pp: int) -> list[Group]:
    """First and last rank of every pipeline (to keep tied embedding/head weights equal); empty when pp == 1."""
    if pp == 1:
        return []
    return [(group[0], group[-1]) for group in pipeline_groups(world_size, pp)]


def model_parallel_groups(ranks: Group, degree: int, consecutive: bool = True) -> list[Group]:
    """Split a stage's ranks into groups of ``degree`` ranks (tensor- or Ulysses-parallel groups)."""
    _check_divides(degree, len(ranks), "degree", "ranks per stage")
    count = len(ranks) // degree
    if consecutive:
        return [tuple(ranks[g * degree + j] for j in range(degree)) for g in range(count)]
    return [tuple(ranks[g + j * count] for j in range(degree)) for g in range(count)]


def data_parallel_groups(ranks: Group, degree: int, consecutive: bool = True) -> list[Group]:
    """The complement of :func:`model_parallel_groups`: ranks holding the same model shard."""
    _check_divides(degree, len(ranks), "degree", "ranks per stage")
    count = len(ranks) // degree
    if consecutive:
        return [tuple(ranks[g * degree + j] for g in range(count)) for j in range(degree)]
    return [tuple(ranks[j * count + g] for g in range(count)) for j in range(degree)]


@dataclass(frozen=True)
class ShardLayout:
    """How a layer's activations (one micro-batch of ``[batch, seq, ...]``) are spread over its stage.

    The batch is split over the data-parallel groups; under context parallelism (``cp`` > 1) each rank of a
    context-parallel group holds its two chunks of the sequence (:func:`galva_schema.sharding.context_chunks`);
    inside a model-parallel group that (context-local) sequence is either replicated (Megatron tp) or split
    contiguously (Megatron-SP, Ulysses: ``seq_sharded``).

    Rank order inside the stage: the model-parallel index is innermost (consecutive) or outermost (strided); the
    other index ``g`` (the layer's sharding group) is ``data-parallel index * cp + context-parallel index``.
    """

    ranks: Group
    degree: int = 1
    consecutive: bool = True
    seq_sharded: bool = False
    cp: int = 1

    def __post_init__(self) -> None:
        _check_divides(self.degree * self.cp, len(self.ranks), "degree x cp", "ranks per stage")

    @property
    def dp(self) -> int:
        return len(self.ranks) // (self.degree * self.cp)

    @property
    def seq_shards(self) -> int:
        """Slices of the context-local sequence inside a model-parallel group."""
        return self.degree if self.seq_sharded else 1

    @property
    def seq_parts(self) -> int:
        """Distinct sequence shares: ``cp`` x :attr:`seq_shards`."""
        return self.cp * self.seq_shards

    @property
    def seq_cell_count(self) -> int:
        """Cells of the sequence grid this layout's shares are made of (:func:`sequence_cell_count`)."""
        return sequence_cell_count(self.cp, self.seq_shards)

    def _indices(self, rank: int) -> tuple[int, int]:
        """(model-parallel index, sharding-group index ``g``) of a global rank of this stage."""
        local = self.ranks.index(rank)
        if self.consecutive:
            return local % self.degree, local // self.degree
        count = len(self.ranks) // self.degree
        return local // count, local % count

    def coords(self, rank: int) -> tuple[int, int]:
        """(model-parallel index, data-parallel index) of a global rank of this stage."""
        mp_index, g = self._indices(rank)
        return mp_index, g // self.cp

    def cp_index(self, rank: int) -> int:
        """Context-parallel index of a global rank of this stage."""
        return self._indices(rank)[1] % self.cp

    def shard(self, rank: int) -> tuple[int, int]:
        """(batch part, sequence part) held by ``rank``, out of ``dp`` batch parts and ``seq_parts`` sequence parts."""
        mp_index, dp_index = self.coords(rank)
        return dp_index, self.cp_index(rank) * self.seq_shards + (mp_index if self.seq_sharded else 0)

    def batch_rows(self, rank: int, batch_size: int) -> slice:
        """Rows of a ``batch_size``-sample micro-batch that ``rank`` holds (the batch-share rule)."""
        batch_part = self.shard(rank)[0]
        return contiguous_block(
            batch_size, self.dp, batch_part, what="micro-batch of", parts_name="data-parallel degree"
        )

    def seq_cells(self, rank: int) -> tuple[int, ...]:
        """The cells of :attr:`seq_cell_count` that ``rank`` holds, in its local order."""
        mp_index = self.coords(rank)[0] if self.seq_sharded else 0
        return sequence_cells(self.cp, self.seq_shards, self.cp_index(rank), mp_index)

    def seq_blocks(self, rank: int, seq_len: int, split: bool = True) -> tuple[slice, ...]:
        """Positions of a ``seq_len``-token sequence that ``rank`` holds, as slices in its local order; with
        ``split`` false, those of its whole context-local sequence (not split over the model-parallel group)."""
        shards = self.seq_shards if split else 1
        mp_index = self.coords(rank)[0] if split and self.seq_sharded else 0
        return sequence_blocks(seq_len, self.cp, shards, self.cp_index(rank), mp_index)

    def local_seq_cells(self, rank: int, seq_cells: int) -> list[int]:
        """The cells of a ``seq_cells`` grid refining this layout that ``rank`` holds, in its local order."""
        per = seq_cells // self.seq_cell_count
        return [cell * per + k for cell in self.seq_cells(rank) for k in range(per)]

    def held_cells(self, rank: int, batch_cells: int, seq_cells: int) -> list[tuple[int, int]]:
        """The cells of a ``batch_cells x seq_cells`` grid refining this layout that ``rank`` holds, in grid order:
        :meth:`holds` for every cell at once, without asking it of each (a 64-rank stage has millions)."""
        per_part = batch_cells // self.dp
        part = self.shard(rank)[0]
        columns = sorted(self.local_seq_cells(rank, seq_cells))
        return [(b, s) for b in range(part * per_part, (part + 1) * per_part) for s in columns]

    def holds(self, rank: int, batch_cell: int, batch_cells: int, seq_cell: int, seq_cells: int) -> bool:
        """Whether ``rank`` holds the cell of a ``batch_cells x seq_cells`` grid refining this layout."""
        batch_part = self.shard(rank)[0]
        return (
            batch_cell * self.dp // batch_cells == batch_part
            and seq_cell * self.seq_cell_count // seq_cells in self.seq_cells(rank)
        )


@dataclass(frozen=True)
class Transfer:
    """Cells that ``src`` sends to ``dst`` (``src == dst`` means a local copy)."""

    src: int
    dst: int
    cells: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RedistributionPlan:
    """Exact re-sharding of one micro-batch from layout ``source`` to layout ``target`` on the same stage.

    The micro-batch is cut into a ``batch_cells x seq_cells`` grid that refines both layouts. Every rank receives
    each cell it needs under ``target`` from one rank that holds it under ``source`` (itself when possible, so a
    pure split costs nothing). Replicated copies carry the full value forward and the full gradient backward, so the
    backward pass is the plan from ``target`` to ``source``. ``groups`` are the connected sets of ranks that
    exchange data: the process groups a runtime needs.
    """

    source: ShardLayout
    target: ShardLayout
    batch_cells: int
    seq_cells: int
    transfers: tuple[Transfer, ...]
    groups: tuple[Group, ...]

    def sends(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == rank]

    def receives(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst == rank]

    def group_of(self, rank: int) -> Group:
        for group in self.groups:
            if rank in group:
                return group
        return (rank,)

    def reverse(self) -> RedistributionPlan:
        """The plan of the backward pass."""
        return redistribution_plan(self.target, self.source)

    def busiest_rank_fraction(self) -> Fraction:
        """Largest share of the micro-batch (its ``[batch, seq]`` activation) that any one rank sends to other
        ranks, or receives from them, under this plan; local copies are free. An exchange in one collective is as
        slow as this rank, so a cost model prices a boundary with it (:func:`busiest_rank_fraction` gives the same
        number without building the plan)."""
        sent: dict[int, int] = {}
        received: dict[int, int] = {}
        for t in self.transfers:
            if t.src != t.dst:
                sent[t.src] = sent.get(t.src, 0) + len(t.cells)
                received[t.dst] = received.get(t.dst, 0) + len(t.cells)
        return _busiest(sent, received, self.batch_cells * self.seq_cells)


def redistribution_plan(source: ShardLayout, target: ShardLayout) -> RedistributionPlan:
    """Plan the exchange that turns ``source``-sharded activations into ``target``-sharded ones."""
    if sorted(source.ranks) != sorted(target.ranks):
        raise ValueError(f"layouts cover different ranks: {source.ranks} and {target.ranks}")
    batch_cells = _lcm(source.dp, target.dp)
    seq_cells = _lcm(source.seq_cell_count, target.seq_cell_count)
    holders: dict[tuple[int, int], list[int]] = {}
    for rank in source.ranks:
        for cell in source.held_cells(rank, batch_cells, seq_cells):
            holders.setdefault(cell, []).append(rank)
    wanted: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for dst in target.ranks:
        for cell in target.held_cells(dst, batch_cells, seq_cells):
            found = holders[cell]
            src = dst if dst in found else _nearest(found, dst, source)
            wanted.setdefault((src, dst), []).append(cell)
    transfers = tuple(Transfer(src, dst, tuple(cells)) for (src, dst), cells in sorted(wanted.items()))
    return RedistributionPlan(source, target, batch_cells, seq_cells, transfers, _components(transfers))


def _nearest(holders: list[int], dst: int, source: ShardLayout) -> int:
    """Pick the source of a remote cell: spread the load by matching model-parallel index, then the closest rank."""
    mp_dst = source.coords(dst)[0]
    same_mp = [r for r in holders if source.coords(r)[0] == mp_dst]
    pool = same_mp or holders
    return min(pool, key=lambda r: (abs(r - dst), r))


def _components(transfers: Iterable[Transfer]) -> tuple[Group, ...]:
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for t in transfers:
        if t.src != t.dst:
            parent[find(t.src)] = find(t.dst)
    members: dict[int, list[int]] = {}
    for rank in list(parent):
        members.setdefault(find(rank), []).append(rank)
    return tuple(sorted(tuple(sorted(m)) for m in members.values() if len(m) > 1))


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
    _check_divides(ep * etp, len(ranks), "ep x etp", "ranks per stage")
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
    _check_divides(cp, len(rest[0]), "cp", "ranks per model-parallel index")
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


# ------------------------------------------------------------------------------------------------ exchange volume
def busiest_rank_fraction(source: ShardLayout, target: ShardLayout) -> Fraction:
    """``redistribution_plan(source, target).busiest_rank_fraction()`` without building the plan.

    Same cells, same sources: a remote cell comes from the rank of the source shard with dst's model-parallel index
    (the one rank of that shard when the sequence is split), which is what ``_nearest`` picks, so the cells of one
    source shard are counted together and no rank is scanned. A planner asks it for every pair of layouts.
    """
    if sorted(source.ranks) != sorted(target.ranks):
        raise ValueError(f"layouts cover different ranks: {source.ranks} and {target.ranks}")
    if source.cp > 1 or target.cp > 1:  # two blocks per share: count the plan's cells
        return redistribution_plan(source, target).busiest_rank_fraction()
    batch_cells = _lcm(source.dp, target.dp)
    seq_cells = _lcm(source.seq_parts, target.seq_parts)
    sb, ss = batch_cells // source.dp, seq_cells // source.seq_parts  # cells per source shard, per axis
    tb, ts = batch_cells // target.dp, seq_cells // target.seq_parts  # cells per target shard, per axis
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for dst in target.ranks:
        batch_part, seq_part = target.shard(dst)
        mp_dst = source.coords(dst)[0]
        b0, s0 = batch_part * tb, seq_part * ts  # first cell dst needs
        for bp in range(b0 // sb, (b0 + tb - 1) // sb + 1):  # source shards overlapping what dst needs
            rows = min(b0 + tb, (bp + 1) * sb) - max(b0, bp * sb)
            for sp in range(s0 // ss, (s0 + ts - 1) // ss + 1):
                src = _rank_at(source, sp if source.seq_sharded else mp_dst, bp)
                if src == dst:
                    continue  # dst holds these cells itself
                cells = rows * (min(s0 + ts, (sp + 1) * ss) - max(s0, sp * ss))
                sent[src] = sent.get(src, 0) + cells
                received[dst] = received.get(dst, 0) + cells
    return _busiest(sent, received, batch_cells * seq_cells)


def _rank_at(layout: ShardLayout, mp_index: int, dp_index: int) -> int:
    """The rank with these coordinates (the inverse of :meth:`ShardLayout.coords`)."""
    local = dp_index * layout.degree + mp_index if layout.consecutive else mp_index * layout.dp + dp_index
    return layout.ranks[local]


def _busiest(sent: dict[int, int], received: dict[int, int], cells: int) -> Fraction:
    return Fraction(max([0, *sent.values(), *received.values()]), cells)


def _check_divides(divisor: int, total: int, name: str, total_name: str) -> None:
    if divisor < 1 or total % divisor:
        raise ValueError(f"{name}={divisor} does not divide {total_name}={total}")


def _lcm(a: int, b: int) -> int:
    from math import gcd

    return a * b // gcd(a, b)


# ------------------------------------------------------------------------------------------------ asked by planners
# A planner prices a layer before any Strategy exists; it asks these instead of restating the conventions above.
def ranks_per_stage(world_size: int, pp: int) -> int:
    """Ranks in one pipeline stage, ``world_size // pp`` (``Strategy.ranks_per_stage`` of a plan not yet written);
    ``ValueError`` when ``pp`` does not divide ``world_size``."""
    _check_divides(pp, world_size, "pp", "world_size")
    return world_size // pp


def tp_consecutive(degree: int, stage_size: int, consecutive: bool) -> bool:
    """Whether a layer's model-parallel group of ``degree`` ranks, on a stage of ``stage_size`` ranks, is a block of
    consecutive ranks: as its ``tp_consecutive`` flag says, except that a group of one rank or of the whole stage is
    the same group either way, and counts as consecutive (as :class:`RankLayout` builds it)."""
    return consecutive or degree in (1, stage_size)


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
