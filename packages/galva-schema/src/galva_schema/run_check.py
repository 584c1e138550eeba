"""``RunCheck``: a trained plan's measured step time and peak memory beside what galva-search predicted for it.

``galva check`` (``galva run``'s check stage) writes it from the training run's own metrics; galva-report shows it.
Each quantity carries its noise band: a relative half-width within which measured and predicted are taken to agree
(a difference inside it is the run's own spread, not a fault of the cost model).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeFloat, PositiveInt

from galva_schema._base import GalvaFile, GalvaModel


class Agreement(GalvaModel):
    """One measured quantity beside its prediction."""

    predicted: NonNegativeFloat
    measured: NonNegativeFloat
    noise: NonNegativeFloat = Field(description="Relative half-width of the band that counts as agreement.")

    @property
    def ratio(self) -> float:
        """measured / predicted (inf for a zero prediction of something measured)."""
        return self.measured / self.predicted if self.predicted else float("inf")

    @property
    def agrees(self) -> bool:
        """Measured within the noise band of the prediction."""
        return abs(self.ratio - 1.0) <= self.noise


class RunCheck(GalvaFile):
    """A training run held against its plan's prediction (stage 0: the rank that logs the metrics)."""

    kind: Literal["galva.run_check"] = "galva.run_check"
    strategy: str = Field(description="The strategy file the run trained.")
    summary: str = Field(description="galva-search's summary of it (the predictions).")
    metrics: str = Field(description="The run's metrics JSONL file (the measurements).")
    timed_steps: PositiveInt = Field(description="Steps the step time is the median of (the first is left out).")
    step_time_s: Agreement = Field(description="Seconds per iteration: median over the timed steps.")
    peak_memory_mib: Agreement = Field(
        description="Peak memory per device, base included: the base the run measured before building the model "
        "plus the peak above it (GPU: the allocator's peak; CPU: the resident high-water mark less the base)."
    )
    base_memory_mib: Agreement = Field(description="The base the search reserved against the one the run measured.")
    calibration: str | None = Field(
        None, description="The calibration written because a quantity fell outside its band; null when all agreed."
    )
