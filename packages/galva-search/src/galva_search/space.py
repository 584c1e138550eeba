"""The search space: every candidate strategy of one transformer layer (reference spec §5).

A :class:`Candidate` fixes, for one layer, the pipeline degree ``pp`` (shared by the whole model), the model-parallel
degree ``tp`` (Megatron tensor parallel, or Ulysses sequence parallel when ``ulysses``), whether that group is made of
consecutive ranks, the data-parallel type, activation checkpointing and the context-parallel degree ``cp`` (ring
attention over two chunks of the sequence per rank). The data-parallel degree follows:
``dp = world_size / (pp * tp * cp)``; gradients and ZeRO shards span ``dp * cp`` ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from galva_comm.layout import ranks_per_stage, sharding_group_shape, tp_consecutive
from galva_schema import DataParallelType

PRESETS = ("full", "3d", "dp+tp", "dp+pp", "dp", "sdp", "tp", "pp")
"""Names accepted by ``SpaceOptions.preset`` (the reference's ``--search_space``)."""

SP_SPACES = ("tp", "tp+sp", "sp")
"""``tp``: Megatron tensor parallel only; ``sp``: Ulysses only; ``tp+sp``: both, per layer."""


@dataclass(frozen=True, order=True)
class Candidate:
    """One layer's parallel plan inside a world of ``world_size`` ranks."""

    pp: int
    tp: int
    dp: int
    consecutive: bool = True
    dp_type: DataParallelType = DataParallelType.DDP
    ulysses: bool = False
    checkpoint: bool = False
    # mixture-of-experts layers: experts over ep ranks, each expert's FFN over etp, replicated over the rest of the
    # stage (expert dp) under expert_dp_type (None: the layer's dp_type); ignored by a dense layer
    ep: int = 1
    etp: int = 1
    expert_dp_type: DataParallelType | None = None
    # context parallelism: the sequence over cp ranks (two chunks each), attention by ring
    cp: int = 1

    @property
    def stage_ranks(self) -> int:
        """Ranks of this layer's pipeline stage: ``tp * cp * dp``."""
        return self.tp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard: the stage's ranks over ``ep * etp``."""
        return self.stage_ranks // (self.ep * self.etp)

    @property
    def tp_degree(self) -> int:
        """Megatron tensor-parallel degree (1 for Ulysses layers)."""
        return 1 if self.ulysses else self.tp

    @property
    def sp_degree(self) -> int:
        """Ulysses degree (1 for Megatron layers)."""
        return self.tp if self.ulysses else 1


@dataclass(frozen=True)
class SpaceOptions:
    """What the search may choose from. Defaults follow the reference's ``galvatron_search_args``."""

    preset: str = "full"
    sp_space: str = "tp"
    default_dp_type: DataParallelType = DataParallelType.DDP
    max_tp: int = 8
    max_pp: int = 8
    max_cp: int = 1
    disable_dp: bool = False
    disable_sdp: bool = False
    disable_tp: bool = False
    disable_pp: bool = False
    disable_ckpt: bool = False
    disable_tp_consec: bool = False
    disable_vtp: bool = False
    ulysses_zero3_at_full_sp: bool = True
    max_ep: int = 64

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"search space {self.preset!r}: expected one of {', '.join(PRESETS)}")
        if self.sp_space not in SP_SPACES:
            raise ValueError(f"sp space {self.sp_space!r}: expected one of {', '.join(SP_SPACES)}")
        if self.disable_dp and self.disable_sdp:
            raise ValueError("disable_dp and disable_sdp cannot both be set: no data-parallel type would be left")
        for name in ("max_tp", "max_pp", "max_ep", "max_cp"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}: {value} is not a power of two >= 1")


def powers_of_two(limit: int) -> list[int]:
    """``[1, 2, 4, ...]`` up to and including ``limit`` (when it is a power of two)."""
    out, value = [], 1
    while value <= limit:
        out.append(value)
        value *= 2
    return out


def generate_space(world_size: int, options: SpaceOptions = SpaceOptions()) -> list[Candidate]:
    """Every candidate layer strategy for ``world_size`` ranks, in a stable order (pp, tp, layout, type, ckpt).

    Rules (reference §5, with the differences listed in docs/cost-model.md):

    * ``pp * tp * cp * dp == world_size``; all degrees are powers of two; ``tp <= max_tp``, ``pp <= max_pp``,
      ``cp <= max_cp`` (1 by default: context parallelism is searched when asked for, with Megatron tp and
      Ulysses alike, on consecutive model-parallel groups only).
    * The consecutive flag only varies when ``1 < tp < world_size / pp`` (otherwise both layouts are the same group).
    * The data-parallel type is the default type or ZeRO-3 where ``dp > 1``; a Ulysses layer with ``dp == 1`` still
      shards its states over its sequence-parallel group, so it keeps the ZeRO-3 choice
      (``ulysses_zero3_at_full_sp``; the reference drops it).
    * ``sp_space`` decides whether layers with ``tp > 1`` use Megatron tp, Ulysses, or either.
    * Presets ``3d``, ``dp``, ``sdp``, ``tp`` and ``pp`` are single strategies without checkpointing, as in the
      reference; ``full``, ``dp+tp`` and ``dp+pp`` are filtered by the ``disable_*`` switches and then doubled with
      an activation-checkpointed copy unless ``disable_ckpt``.
    """
    if world_size < 1 or world_size & (world_size - 1):
        raise ValueError(f"world size {world_size} is not a power of two")
    o = options
    zero3 = DataParallelType.ZERO3
    default = o.default_dp_type
    dp_types = [default] if default is zero3 else [default, zero3]
    preset = o.preset

    def layouts(pp: int, tp: int) -> Iterable[bool]:  # both only where they are different groups
        return (True,) if tp_consecutive(tp, ranks_per_stage(world_size, pp), False) else (True, False)

    def ulysses_flags(tp: int) -> Iterable[bool]:
        if tp == 1:
            return (False,)
        return {"tp": (False,), "sp": (True,), "tp+sp": (False, True)}[o.sp_space]

    base: list[Candidate] = []
    if preset in ("full", "dp+tp", "dp+pp"):
        for pp in powers_of_two(world_size):
            stage = ranks_per_stage(world_size, pp)
            degrees = [(t, c) for t in powers_of_two(stage) for c in powers_of_two(min(o.max_cp, stage // t))]
            for tp, cp in degrees:
                dp = stage // (tp * cp)
                if (preset == "dp+tp" and pp > 1) or (preset == "dp+pp" and tp > 1) or (preset != "full" and cp > 1):
                    continue
                for ulysses in ulysses_flags(tp):
                    shard = sharding_group_shape(stage, tp, True, ulysses)[0]  # dp x cp (x sp) ranks
                    types = dp_types if shard > 1 else [default]
                    if dp * cp == 1 and not (ulysses and o.ulysses_zero3_at_full_sp):
                        types = [default]
                    if preset != "full":
                        types = [default]
                    # a ring of cp model-parallel groups: only consecutive ones (a strided tp group's ring would
                    # span the stage; and the candidates a 64-rank search solves stay few enough for 1 s)
                    for consecutive in layouts(pp, tp) if cp == 1 else (True,):
                        for dp_type in types:
                            base.append(Candidate(pp, tp, dp, consecutive, dp_type, ulysses, cp=cp))
        disable_sdp = o.disable_sdp or preset in ("dp+tp", "dp+pp")
        keep = []
        for c in base:
            if o.disable_dp and c.dp > 1 and c.dp_type is not zero3:
                continue
            if disable_sdp and c.dp_type is zero3 and default is not zero3:
                continue
            if o.disable_tp and c.tp > 1:
                continue
            if (o.disable_pp or preset == "dp+tp") and c.pp > 1:
                continue
            if o.disable_tp_consec and not c.consecutive:
                continue
            if c.tp > o.max_tp or c.pp > o.max_pp:
                continue
            keep.append(c)
        if not o.disable_ckpt:
            keep = keep + [_with_checkpoint(c) for c in keep]
        return keep
    # single-strategy presets: returned as they are, without checkpointing (as the reference does)
    if preset == "3d":
        if world_size < 4:
            return []
        return [Candidate(2, 2, world_size // 4, True, default)]
    if preset == "dp":
        return [Candidate(1, 1, world_size, True, default)]
    if preset == "sdp":
        return [Candidate(1, 1, world_size, True, zero3)]
    if preset == "tp":
        tp = min(o.max_tp, world_size)
        return [Candidate(1, tp, world_size // tp, True, default)]
    pp = min(o.max_pp, world_size)  # preset == "pp"
    return [Candidate(pp, 1, ranks_per_stage(world_size, pp), True, default)]


def _with_checkpoint(candidate: Candidate) -> Candidate:
    return replace(candidate, checkpoint=True)


def with_expert_layouts(
    candidates: Sequence[Candidate], expert_types: Sequence[tuple[int, int]], max_ep: int = 64
) -> list[Candidate]:
    """``candidates`` with every expert layout a mixture-of-experts layer may take beside each (none added when
    ``expert_types``, the ``(experts, expert FFN size)`` of each layer type with experts, is empty).

    Per candidate: ``ep`` a power of two up to ``max_ep`` dividing some layer type's experts, ``etp`` 1 or the
    candidate's Megatron tp (the two layouts Megatron users write: experts whole, or split as the dense FFN is),
    ``ep * etp`` dividing the stage's ranks; the experts keep the layer's data-parallel type. Which layer type may
    take which layout is the model's rules' question (galva_search.rules).
    """
    if not expert_types:
        return list(candidates)
    out: list[Candidate] = []
    for c in candidates:
        for etp in sorted({1, c.tp_degree}):
            if not any(ffn % etp == 0 for _, ffn in expert_types):
                continue
            for ep in powers_of_two(min(max_ep, c.stage_ranks // etp)):
                if any(experts % ep == 0 for experts, _ in expert_types):
                    out.append(c if ep == etp == 1 else replace(c, ep=ep, etp=etp))
    return out
