"""What a job's heartbeats say: each rank's last published state and the one-line verdict on a job that stopped
making progress (which rank, its step, the collective the others waited in). Pure: the
:class:`~galva_hp.watchdog.Watchdog` thread publishes and reads the heartbeats and acts on the verdict."""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["Heartbeat", "diagnose", "step_text"]


@dataclass(frozen=True)
class Heartbeat:
    """One rank's last published state (``time`` and ``progress_time`` are wall-clock seconds)."""

    rank: int
    time: float
    progress_time: float
    step: int
    collective: str | None
    collectives: int
    host: str
    pid: int

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str | bytes) -> Heartbeat:
        return cls(**json.loads(text))

    @property
    def where(self) -> str:
        return step_text(self.step) + ", " + (f"in {self.collective}" if self.collective else "between collectives")


def step_text(step: int) -> str:
    """Where a rank is, named by its last completed step (``step`` is the one in progress: 1-based, 0 before the
    first): ``after step 6``, ``in step 1`` (none completed yet), ``before the first step``."""
    if step <= 0:
        return "before the first step"
    return "in step 1" if step == 1 else f"after step {step - 1}"


def diagnose(
    beats: dict[int, Heartbeat], world_size: int, now: float, threshold: float, startup: float | None = None
) -> str | None:
    """The one-line verdict on a job whose ranks published ``beats``, or None while it makes progress.

    ``threshold`` seconds without a heartbeat (or without progress on every rank) make a rank stuck; before every
    rank has reached its first step, ``startup`` seconds (default: ``threshold``) without progress.
    """
    started = len(beats) == world_size and all(b.step >= 1 for b in beats.values())
    patience = threshold if started or startup is None else max(threshold, startup)
    missing = [r for r in range(world_size) if r not in beats]
    stale = sorted(r for r, b in beats.items() if now - b.time > threshold)
    waiting = [b for r, b in sorted(beats.items()) if r not in stale and b.collective]
    if stale or (missing and beats and all(now - b.progress_time > patience for b in beats.values())):
        culprit = (stale or missing)[0]
        beat = beats.get(culprit)
        what = (
            f"rank {culprit} stopped responding (no heartbeat for {now - beat.time:.0f} s; last seen {beat.where})"
            if beat is not None
            else f"rank {culprit} never reported"
        )
        return what + _waiting(waiting)
    if beats and len(beats) == world_size and all(now - b.progress_time > patience for b in beats.values()):
        culprit_beat = min(beats.values(), key=lambda b: (b.step, b.collectives, b.rank))
        others = [b for b in waiting if b.rank != culprit_beat.rank]
        return (
            f"rank {culprit_beat.rank} made no progress for {now - culprit_beat.progress_time:.0f} s "
            f"({culprit_beat.where})" + _waiting(others)
        )
    return None


def _waiting(beats: list[Heartbeat]) -> str:
    if not beats:
        return ""
    first = beats[0]
    ranks = ", ".join(str(b.rank) for b in beats)
    return f"; rank{'s' if len(beats) > 1 else ''} {ranks} waited in {first.collective} {step_text(first.step)}"
