"""Which share of a ``[batch, seq, ...]`` activation each rank of a stage holds under a layer's layout
(:class:`ShardLayout`), the plan that moves the shares from one layout to another (:class:`RedistributionPlan`), and
how much the busiest rank of such a move exchanges. Pure Python: no torch. The groups themselves are
:mod:`galva_comm.layout`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from galva_schema.sharding import contiguous_block, sequence_blocks, sequence_cell_count, sequence_cells

Group = tuple[int, ...]


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
        check_divides(self.degree * self.cp, len(self.ranks), "degree x cp", "ranks per stage")

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
    # ShardLayout.shard and .coords of every rank, from its local index (cp 1: the sharding group is the dp index),
    # and the source rank of a shard by _rank_at's rule, inline: a planner asks this for hundreds of pairs of 64-rank
    # layouts, and the method calls (each a list search) were most of its time
    where = {rank: local for local, rank in enumerate(source.ranks)}
    t_groups, s_groups = len(target.ranks) // target.degree, len(source.ranks) // source.degree
    s_ranks, s_degree, s_dp, s_consecutive, s_split = (
        source.ranks, source.degree, source.dp, source.consecutive, source.seq_sharded
    )
    for local, dst in enumerate(target.ranks):
        if target.consecutive:
            t_mp, batch_part = local % target.degree, local // target.degree
        else:
            t_mp, batch_part = local // t_groups, local % t_groups
        seq_part = t_mp if target.seq_sharded else 0
        s_local = where[dst]
        mp_dst = s_local % s_degree if s_consecutive else s_local // s_groups
        b0, s0 = batch_part * tb, seq_part * ts  # first cell dst needs
        b1, s1 = b0 + tb, s0 + ts
        got = 0
        # (the bounds below are min/max written out: builtin calls were a third of this loop's time)
        for bp in range(b0 // sb, (b1 - 1) // sb + 1):  # source shards overlapping what dst needs
            top, bottom = (bp + 1) * sb, bp * sb
            rows = (b1 if b1 < top else top) - (b0 if b0 > bottom else bottom)
            if not s_split:  # one rank (dst's model-parallel index) holds the shard's whole sequence: ts columns
                src = s_ranks[bp * s_degree + mp_dst if s_consecutive else mp_dst * s_dp + bp]
                if src != dst:  # else dst holds these cells itself
                    sent[src] = sent.get(src, 0) + rows * ts
                    got += rows * ts
                continue
            for sp in range(s0 // ss, (s1 - 1) // ss + 1):
                src = s_ranks[bp * s_degree + sp if s_consecutive else sp * s_dp + bp]
                if src == dst:
                    continue
                right, left = (sp + 1) * ss, sp * ss
                cells = rows * ((s1 if s1 < right else right) - (s0 if s0 > left else left))
                sent[src] = sent.get(src, 0) + cells
                got += cells
        if got:
            received[dst] = got
    return _busiest(sent, received, batch_cells * seq_cells)


def _busiest(sent: dict[int, int], received: dict[int, int], cells: int) -> Fraction:
    return Fraction(max([0, *sent.values(), *received.values()]), cells)




def _lcm(a: int, b: int) -> int:
    from math import gcd

    return a * b // gcd(a, b)


def check_divides(divisor: int, total: int, name: str, total_name: str) -> None:
    """``ValueError`` naming both sizes unless ``divisor`` divides ``total``."""
    if divisor < 1 or total % divisor:
        raise ValueError(f"{name}={divisor} does not divide {total_name}={total}")
