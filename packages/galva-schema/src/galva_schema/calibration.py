"""``Calibration``: per-term correction factors of galva-search's cost model, fitted by ``galva-profile check`` or
by ``galva run``'s check stage (one trained plan against its prediction).

The check runs strategies for real and compares every predicted term family with the runtime. The factors multiply
the cost model's terms (``galva-search --calibration FILE``), so the planner learns from the machine it plans for;
``points`` records what the fit saw, so a reader can judge the factors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from galva_schema._base import GalvaFile, GalvaModel


class TimeFactors(GalvaModel):
    """Multipliers of the cost model's time terms (1.0: as predicted from the profiles)."""

    compute: float = Field(1.0, gt=0.0, le=1000.0, description="Forward, backward and recomputation time.")
    tp_comm: float = Field(1.0, gt=0.0, le=1000.0, description="Megatron tp / Megatron-SP / Ulysses collectives.")
    dp_comm: float = Field(1.0, gt=0.0, le=1000.0, description="Gradient synchronisation and ZeRO-3 gathers.")
    p2p: float = Field(1.0, gt=0.0, le=1000.0, description="Pipeline point-to-point sends.")
    redistribution: float = Field(1.0, gt=0.0, le=1000.0, description="Re-sharding between layers.")


class MemoryFactors(GalvaModel):
    """Multipliers of the cost model's memory terms."""

    states: float = Field(1.0, gt=0.0, le=1000.0, description="Parameters, gradients and optimizer states.")
    activations: float = Field(1.0, gt=0.0, le=1000.0, description="Activation bytes, kept and transient.")


class CalibrationPoint(GalvaModel):
    """One strategy the factors were fitted on: measured and predicted iteration time, before and after."""

    strategy: str
    measured_s: float = Field(ge=0.0)
    predicted_s: float = Field(ge=0.0, description="Uncalibrated prediction.")
    calibrated_s: float = Field(ge=0.0, description="Prediction with these factors.")


class Calibration(GalvaFile):
    """Per-term correction factors for galva-search, fitted from real runs of strategies on one machine."""

    kind: Literal["galva.calibration"] = "galva.calibration"
    model_name: str | None = Field(None, description="Model whose runs were fitted.")
    world_size: int | None = Field(None, ge=1, description="Ranks of the runs.")
    time_factors: TimeFactors = Field(default_factory=TimeFactors)
    memory_factors: MemoryFactors = Field(default_factory=MemoryFactors)
    points: tuple[CalibrationPoint, ...] = Field((), description="The runs the factors were fitted on.")
    base_memory_mib: float | None = Field(
        None,
        ge=0.0,
        description="Per-device base memory a run measured (its peak less the memory terms the cost model prices); "
        "galva-search reserves it in place of the hardware profile's. None: keep the profile's.",
    )
