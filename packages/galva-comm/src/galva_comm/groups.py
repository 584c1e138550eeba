"""Process groups for a :class:`~galva_comm.layout.RankLayout`, one communicator per distinct rank tuple.

``torch.distributed.new_group`` must be called by every rank, for every group, in the same order. The cache creates
all groups of a layout up front in :meth:`RankLayout.all_groups` order and then hands out the same group object to
every layer that uses the same ranks, so a 32-layer plan with mixed tp creates a handful of communicators, not 32
per kind (the reference system created sharding and redistribution groups per layer and ran out of NCCL memory).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from galva_comm.layout import Group, RankLayout

if TYPE_CHECKING:  # torch is imported lazily so that the layout maths works without it
    from torch.distributed import ProcessGroup


def default_group_timeout() -> Any:
    """The timeout the world group was created with (``init_process_group(timeout=...)``), or None.

    ``torch.distributed.new_group`` without a timeout falls back to torch's 30-minute default, not to the world's:
    every group the cache creates gets the world's timeout instead, so one ``--collective-timeout`` holds everywhere.
    """
    import torch
    import torch.distributed as dist

    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError, ValueError):
        try:  # an accelerator-only world (NCCL)
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
            return backend.options._timeout
        except (AttributeError, RuntimeError, ValueError):
            return None


class ProcessGroupCache:
    """Creates and remembers process groups keyed by their sorted rank tuple; each group gets ``timeout``, by
    default the world group's (see :func:`default_group_timeout`)."""

    def __init__(self, backend: str | None = None, timeout: Any = None) -> None:
        self._backend = backend
        self._timeout = timeout
        self._groups: dict[Group, ProcessGroup] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, ranks: Sequence[int]) -> bool:
        return tuple(sorted(ranks)) in self._groups

    def create(self, groups: Iterable[Sequence[int]]) -> None:
        """Create every group not yet cached. Collective: all ranks must call it with the same list, same order."""
        import torch.distributed as dist

        world = dist.get_world_size()
        for ranks in groups:
            key = tuple(sorted(ranks))
            if key in self._groups:
                continue
            if any(r < 0 or r >= world for r in key):
                raise ValueError(f"group {key} has ranks outside the world of {world}")
            if len(key) == world:
                self._groups[key] = dist.group.WORLD  # type: ignore[assignment]
                continue
            kwargs: dict[str, Any] = {}
            timeout = self._timeout if self._timeout is not None else default_group_timeout()
            if timeout is not None:
                kwargs["timeout"] = timeout
            group = dist.new_group(list(key), backend=self._backend, **kwargs)
            self._groups[key] = group

    def get(self, ranks: Sequence[int]) -> ProcessGroup:
        """The group of ``ranks``; it must have been created by :meth:`create` (on every rank)."""
        key = tuple(sorted(ranks))
        try:
            return self._groups[key]
        except KeyError:
            raise KeyError(f"process group {key} was not created; call create() with it on every rank first") from None

    def create_for_layout(self, layout: RankLayout) -> None:
        """Create every multi-rank group of a strategy's layout (collective)."""
        self.create(layout.all_groups())
