"""torch.distributed's communication calls, intercepted for a while: one mechanism for everything that watches them.

Galva's code and the libraries it drives (FSDP2, megatron-core's layers, galva-hp's mappings) look torch.distributed's
functions up by attribute at each call, so replacing the attribute is seen by all of them, and putting the original
back undoes it. :class:`Intercept` does that for a list of names: while installed, each call goes through
``around(name, call, args, kwargs)``, which must call ``call(*args, **kwargs)`` once and return its result. The
watchdog (galva-hp: which call a stuck rank is in) and the profiler's CPU meter (galva-profiler: the CPU a layer
spends inside its collectives) both use it. Several intercepts may be installed at once; each restores what it found,
so they must be removed in the reverse order of installation (a ``with`` block does that).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["CALLS", "COLLECTIVES", "Around", "Intercept"]

COLLECTIVES: tuple[str, ...] = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "all_to_all",
    "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
    "broadcast_object_list", "reduce", "gather", "scatter", "all_reduce_coalesced", "_all_gather_base",
    "_reduce_scatter_base",
)  # fmt: skip
"""torch.distributed's collectives (those absent from the installed torch are skipped)."""

CALLS: tuple[str, ...] = (
    *COLLECTIVES, "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip
"""Every call of torch.distributed that waits for other ranks: the collectives, barriers and point-to-point."""

Around = Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
"""``around(name, call, args, kwargs)``: runs ``call(*args, **kwargs)`` and returns its result."""


class Intercept:
    """While installed (:meth:`install` / :meth:`remove`, or a ``with`` block), each of ``names`` that
    torch.distributed has is replaced by a wrapper that runs ``around``. ``key`` names the owner: a function this
    owner has wrapped already (an intercept of the same key installed and not removed) is left as it is, so the same
    watcher never counts a call twice."""

    def __init__(self, around: Around, names: tuple[str, ...] = CALLS, key: str = "galva") -> None:
        self.around, self.names, self.key = around, names, key
        self._originals: dict[str, Callable[..., Any]] = {}

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def install(self) -> Intercept:
        import torch.distributed as dist

        for name in self.names:
            current = getattr(dist, name, None)
            if current is None or getattr(current, "_galva_intercept", None) == self.key:
                continue
            self._originals[name] = current
            setattr(dist, name, self._wrapped(name, current))
        return self

    def remove(self) -> None:
        import torch.distributed as dist

        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def __enter__(self) -> Intercept:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _wrapped(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        around = self.around

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return around(name, fn, args, kwargs)

        call._galva_intercept = self.key  # type: ignore[attr-defined]
        return call
