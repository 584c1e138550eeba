"""Intercepting torch.distributed's calls: seen by callers that look them up per call, nested, undone in order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from galva_comm.intercept import CALLS, COLLECTIVES, Intercept
from galva_comm.testing import run_distributed


def _intercepts(rank: int, world: int) -> dict[str, Any]:
    seen: dict[str, list[str]] = {"outer": [], "inner": []}

    def watcher(label: str):  # type: ignore[no-untyped-def]
        def around(name, call, args, kwargs):  # type: ignore[no-untyped-def]
            seen[label].append(name)
            return call(*args, **kwargs)

        return around

    original, barrier = dist.all_reduce, dist.barrier
    outer = Intercept(watcher("outer"), CALLS, key="outer").install()
    again = Intercept(watcher("outer"), CALLS, key="outer").install()  # the same owner twice: no second wrapper
    with Intercept(watcher("inner"), COLLECTIVES, key="inner"):
        t = torch.ones(4)
        dist.all_reduce(t)  # both see it, the inner first
        dist.barrier()  # a barrier is not a collective the inner one asked for
    after_inner = dist.all_reduce is not original and getattr(dist.all_reduce, "_galva_intercept", None) == "outer"
    again.remove()
    outer.remove()
    try:
        with Intercept(lambda name, call, args, kwargs: call(*args, **kwargs), ("all_reduce",)):
            dist.all_reduce(torch.ones(2), op="not an op")  # the call's own error comes through, and it is undone
    except Exception as err:  # any error of torch's is the point
        raised = type(err).__name__
    else:
        raised = ""
    return {
        "seen": seen,
        "value": float(t[0]),
        "after_inner": after_inner,
        "restored": dist.all_reduce is original and dist.barrier is barrier,
        "again_installed": again.installed,
        "raised": raised,
        "still_original": dist.all_reduce is original,
    }


@pytest.mark.distributed
def test_intercepts_see_every_call_nest_and_restore_what_they_found() -> None:
    for got in run_distributed(_intercepts, 2, timeout=60):
        assert got["seen"]["inner"] == ["all_reduce"]
        assert got["seen"]["outer"] == ["all_reduce", "barrier"]  # once each: the same owner never wraps twice
        assert got["value"] == 2.0  # the call itself ran, once
        assert got["after_inner"] and not got["again_installed"]
        assert got["restored"] and got["still_original"] and got["raised"]
