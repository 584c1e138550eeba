"""What a planner asks galva_comm.layout before any Strategy exists agrees with the groups RankLayout builds."""

from __future__ import annotations

import itertools

import pytest

from galva_comm.layout import RankLayout, ranks_per_stage, sharding_group_shape, tp_consecutive
from galva_schema import DataParallelType, Strategy


def _shape(group: tuple[int, ...]) -> tuple[int, bool]:
    return len(group), group == tuple(range(group[0], group[0] + len(group)))


@pytest.mark.parametrize(("world_size", "pp"), [(8, 1), (8, 2), (16, 4)])
def test_answers_match_the_groups_of_a_written_strategy(world_size: int, pp: int) -> None:
    stage = ranks_per_stage(world_size, pp)
    assert stage == world_size // pp
    degrees = [d for d in (1, 2, 4, 8) if d <= stage]
    forms = [(d, c, u) for d, c, u in itertools.product(degrees, (True, False), (False, True)) if not (u and d == 1)]
    layers = [{"tp": d, "tp_consecutive": c, "ulysses": u, "dp_type": DataParallelType.ZERO3.value}
              for d, c, u in forms]
    per_stage = -(-len(layers) // pp)  # ceil: every stage holds some layers
    layers += [{"tp": 1}] * (per_stage * pp - len(layers))
    strategy = Strategy.from_dict({"world_size": world_size, "pp": pp, "pp_division": [per_stage] * pp,
                                   "global_batch_size": 8 * world_size, "layers": layers})
    layout = RankLayout(strategy)
    for index, (degree, consecutive, ulysses) in enumerate(forms):
        groups = layout.layers[index]
        asked = tp_consecutive(degree, stage, consecutive)
        mp = groups.sp[0] if ulysses else groups.tp[0]
        assert _shape(mp) == (degree, asked), (degree, consecutive, ulysses)  # a block exactly when asked says so
        assert sharding_group_shape(stage, degree, consecutive, ulysses) == _shape(groups.shard[0])
    # the vocabulary layers: consecutive groups, sp their Ulysses flag
    for degree, sp in itertools.product(degrees, (False, True)):
        vocab = Strategy.from_dict({**strategy.to_dict(), "vocab": {"tp": degree, "sp": sp and degree > 1}})
        first = RankLayout(vocab).vocab_first
        assert sharding_group_shape(stage, degree, True, sp and degree > 1) == _shape(first.shard[0])


def test_one_rank_or_the_whole_stage_counts_as_consecutive() -> None:
    assert tp_consecutive(1, 8, False) and tp_consecutive(8, 8, False) and tp_consecutive(2, 8, True)
    assert not tp_consecutive(2, 8, False) and not tp_consecutive(4, 8, False)
    assert sharding_group_shape(8, 2, True, False) == (4, False)  # tp blocks: the dp group is strided
    assert sharding_group_shape(8, 2, False, False) == (4, True)  # strided tp: the dp group is a block
    assert sharding_group_shape(8, 2, True, True) == (8, True)  # Ulysses: the whole stage
    with pytest.raises(ValueError, match="pp=3 does not divide world_size=8"):
        ranks_per_stage(8, 3)
