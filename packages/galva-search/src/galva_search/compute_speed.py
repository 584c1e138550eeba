"""The factor on every profiled compute time: what the job's ranks pay for a layer the model profile timed alone."""

from __future__ import annotations

from galva_schema import HardwareProfile, ModelProfile


def compute_scale(hardware: HardwareProfile, model: ModelProfile) -> float:
    """The hardware profile's ``compute_slowdown`` (every rank computing at once against one rank alone), times the
    model profile's minutes against the hardware profile's: where both timed the reference matmul
    (``compute_reference_ms``), ``hardware / model``, so that a layer timed while the machine ran slow is priced
    at the speed the hardware profile measured its slowdown against (docs/cost-model.md §3)."""
    scale = hardware.compute_slowdown
    if hardware.compute_reference_ms is not None and model.compute_reference_ms is not None:
        scale *= hardware.compute_reference_ms / model.compute_reference_ms
    return scale
