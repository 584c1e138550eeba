"""Search-space generation (reference spec §5)."""

from __future__ import annotations

import pytest

from galva_comm.layout import tp_consecutive
from galva_schema import DataParallelType
from galva_search.space import Candidate, SpaceOptions, generate_space

ZERO3 = DataParallelType.ZERO3


def label(c: Candidate) -> str:
    """The reference's compact form of its logs: ``pp-tp[*]-dp[f|z2|d][-c][-sp]`` (``*``: a consecutive tp group
    that is not consecutive by necessity; ``f``: ZeRO-3, ``z2``: ZeRO-2)."""
    star = "*" if c.consecutive and not tp_consecutive(c.tp, c.tp * c.dp, False) else ""
    suffix = {DataParallelType.DDP: "", DataParallelType.ZERO2: "z2", ZERO3: "f"}[c.dp_type]
    return f"{c.pp}-{c.tp}{star}-{c.dp}{suffix}" + "-c" * c.checkpoint + "-sp" * c.ulysses


def labels(space):
    return [label(c) for c in space]


def test_reference_count_74_and_our_80():
    """W = 8, full, tp+sp: the reference's 74 (37 x 2 for checkpointing). Galva adds ZeRO-3 to the three Ulysses
    strategies with dp = 1 (1-8-1-sp, 2-4-1-sp, 4-2-1-sp), whose states are still sharded over the sp group: 80."""
    reference = generate_space(8, SpaceOptions(sp_space="tp+sp", ulysses_zero3_at_full_sp=False))
    assert len(reference) == 74
    ours = generate_space(8, SpaceOptions(sp_space="tp+sp"))
    assert len(ours) == 80
    extra = set(labels(ours)) - set(labels(reference))
    assert extra == {"1-8-1f-sp", "2-4-1f-sp", "4-2-1f-sp", "1-8-1f-c-sp", "2-4-1f-c-sp", "4-2-1f-c-sp"}
    base = [c for c in reference if not c.checkpoint]
    assert len(base) == 37
    assert labels(base)[:6] == ["1-1-8", "1-1-8f", "1-2*-4", "1-2*-4f", "1-2-4", "1-2-4f"]


def test_every_candidate_fills_the_world():
    for world in (1, 2, 4, 8, 16, 64):
        for c in generate_space(world, SpaceOptions(sp_space="tp+sp", max_tp=64, max_pp=64)):
            assert c.pp * c.tp * c.dp == world
            if not 1 < c.tp < world // c.pp:
                assert c.consecutive  # one layout only


def test_sp_space_modes():
    tp_only = generate_space(8, SpaceOptions(sp_space="tp"))
    sp_only = generate_space(8, SpaceOptions(sp_space="sp"))
    assert not any(c.ulysses for c in tp_only)
    assert all(c.ulysses for c in sp_only if c.tp > 1)
    assert len(tp_only) == 2 * 22  # 37 - 15 Ulysses strategies, doubled for checkpointing


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("dp", ["1-1-8"]),
        ("sdp", ["1-1-8f"]),
        ("tp", ["1-8-1"]),
        ("pp", ["8-1-1"]),
        ("3d", ["2-2*-2"]),
    ],
)
def test_single_strategy_presets(preset, expected):
    assert labels(generate_space(8, SpaceOptions(preset=preset))) == expected


def test_dp_tp_and_dp_pp_presets():
    dp_tp = generate_space(8, SpaceOptions(preset="dp+tp"))
    assert all(c.pp == 1 and c.dp_type is not ZERO3 for c in dp_tp)
    assert {c.tp for c in dp_tp} == {1, 2, 4, 8}
    dp_pp = generate_space(8, SpaceOptions(preset="dp+pp"))
    assert all(c.tp == 1 and c.dp_type is not ZERO3 for c in dp_pp)
    assert {c.pp for c in dp_pp} == {1, 2, 4, 8}


def test_disable_switches_and_limits():
    full = generate_space(8)
    assert any(c.checkpoint for c in full)
    assert not any(c.checkpoint for c in generate_space(8, SpaceOptions(disable_ckpt=True)))
    assert all(c.tp == 1 for c in generate_space(8, SpaceOptions(disable_tp=True)))
    assert all(c.pp == 1 for c in generate_space(8, SpaceOptions(disable_pp=True)))
    assert all(c.consecutive for c in generate_space(8, SpaceOptions(disable_tp_consec=True)))
    assert all(c.dp == 1 or c.dp_type is ZERO3 for c in generate_space(8, SpaceOptions(disable_dp=True)))
    assert all(c.dp_type is not ZERO3 for c in generate_space(8, SpaceOptions(disable_sdp=True)))
    limited = generate_space(64, SpaceOptions(max_tp=4, max_pp=2))
    assert max(c.tp for c in limited) == 4 and max(c.pp for c in limited) == 2


def test_default_dp_type_zero3_has_no_duplicates():
    space = generate_space(8, SpaceOptions(default_dp_type=ZERO3))
    assert len(space) == len(set(space))
    assert all(c.dp_type is ZERO3 for c in space)


@pytest.mark.parametrize(
    "kwargs",
    [{"preset": "bogus"}, {"sp_space": "cp"}, {"disable_dp": True, "disable_sdp": True}, {"max_tp": 3}],
)
def test_bad_options_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SpaceOptions(**kwargs)


def test_world_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        generate_space(6)
