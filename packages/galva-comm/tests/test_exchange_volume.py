"""How much of a micro-batch the busiest rank moves under a redistribution plan: from the plan, and without it."""

from __future__ import annotations

from fractions import Fraction

import pytest

from galva_comm.shards import ShardLayout, busiest_rank_fraction, redistribution_plan

FOUR = (0, 1, 2, 3)


def layouts(ranks: tuple[int, ...]) -> list[ShardLayout]:
    """Every layout of a stage: degree, group layout and sequence split."""
    out = []
    degree = 1
    while degree <= len(ranks):
        for consecutive in (True, False):
            for seq_sharded in (False, True):
                out.append(ShardLayout(ranks, degree, consecutive, seq_sharded))
        degree *= 2
    return out


@pytest.mark.parametrize(
    ("source", "target", "expected"),
    [
        ((1, True, False), (2, True, False), Fraction(1, 4)),  # fetch the other sample of the pair
        ((2, True, False), (1, True, False), Fraction(0)),  # a split is local
        ((1, True, False), (4, True, False), Fraction(3, 4)),  # every rank gathers the three others' samples
        ((2, True, False), (2, False, False), Fraction(1, 2)),  # ranks 1 and 2 hold none of what they need
        ((2, True, True), (1, True, False), Fraction(1, 8)),  # the other sequence half of one sample
        ((2, True, False), (2, True, False), Fraction(0)),
    ],
)
def test_busiest_rank_fraction_by_hand(source, target, expected):
    plan = redistribution_plan(ShardLayout(FOUR, *source), ShardLayout(FOUR, *target))
    assert plan.busiest_rank_fraction() == expected
    assert busiest_rank_fraction(ShardLayout(FOUR, *source), ShardLayout(FOUR, *target)) == expected


def test_busiest_rank_fraction_counts_sends_too():
    """1 -> 4 consecutive on 4 ranks: each rank sends its sample to three others (3/4), and receives three."""
    plan = redistribution_plan(ShardLayout(FOUR, 1), ShardLayout(FOUR, 4))
    sent = {r: sum(len(t.cells) for t in plan.sends(r) if t.dst != r) for r in FOUR}
    assert sent == {0: 3, 1: 3, 2: 3, 3: 3} and plan.batch_cells * plan.seq_cells == 4


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("first", [0, 16])
def test_without_the_plan_equals_the_plan(size, first):
    """Every pair of layouts of a stage (also a stage that does not start at rank 0)."""
    ranks = tuple(range(first, first + size))
    for source in layouts(ranks):
        for target in layouts(ranks):
            expected = redistribution_plan(source, target).busiest_rank_fraction()
            assert busiest_rank_fraction(source, target) == expected, (source, target)


def test_layouts_on_different_ranks_are_refused():
    with pytest.raises(ValueError, match="different ranks"):
        busiest_rank_fraction(ShardLayout((0, 1)), ShardLayout((2, 3)))
