"""The training settings the cost model prices a plan under, and the calibration's per-term factors."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from galva_comm.buckets import BUCKET_CAP_BYTES
from galva_schema import DataParallelType, PipelineSchedule, Precision, Strategy
from galva_search.states import state_bytes

if TYPE_CHECKING:  # a search without --calibration never builds the calibration's models
    from galva_schema import Calibration


@dataclass(frozen=True)
class TermFactors:
    """Per-term correction factors (a :class:`galva_schema.Calibration` fitted by ``galva-profile check``).

    Each multiplies one family of terms of the cost model; 1.0 everywhere is the uncalibrated model.
    """

    compute: float = 1.0  # forward, backward and recomputation of layers and vocabulary layers
    tp_comm: float = 1.0  # Megatron tp / Megatron-SP / Ulysses collectives, vocabulary tp
    dp_comm: float = 1.0  # gradient synchronisation and ZeRO-3 gathers
    p2p: float = 1.0  # pipeline sends
    redistribution: float = 1.0  # re-sharding between layers of different layouts
    states: float = 1.0  # model-state bytes
    activations: float = 1.0  # activation bytes (kept and transient)

    @classmethod
    def from_calibration(cls, calibration: Calibration) -> TermFactors:
        t, m = calibration.time_factors, calibration.memory_factors
        return cls(t.compute, t.tp_comm, t.dp_comm, t.p2p, t.redistribution, m.states, m.activations)


@dataclass(frozen=True)
class CostSettings:
    """Training settings the cost model needs; defaults follow the reference (§4 ``TrainArgs``/``ParallelArgs``)."""

    precision: Precision = Precision.BF16
    backward_coefficient: float = 2.0  # backward compute time = coefficient * forward compute time
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    default_dp_type: DataParallelType = DataParallelType.DDP
    megatron_sp: bool = False
    context_mib: float = 1024.0  # framework/CUDA context and allocator overhead per device
    # model-state bytes per parameter: "galva-hp" (what galva-hp holds, measured by galva-profile check: bf16
    # 2 + 4 + 12 and FSDP2's peaks; docs §4), the default since galva-hp runs the plans, or "reference" (bf16
    # 2 + 2 + 12, the reference's formulas: under-counts galva-hp's bf16 ddp states by 11%)
    state_accounting: str = "galva-hp"
    switch_penalty_s: float = 1e-9  # additive tie-breaker per change of dp type or checkpointing between layers
    factors: TermFactors = TermFactors()  # calibration (galva-search --calibration FILE)
    # ddp units of one chunk and group share one gradient all-reduce up to this many bytes, as galva-hp forms its
    # buckets (BuildOptions.bucket_cap_bytes; galva_comm.buckets); 0: one all-reduce per layer
    bucket_cap_bytes: float = BUCKET_CAP_BYTES

    def __post_init__(self) -> None:
        state_bytes(self.precision, self.state_accounting)  # an unknown accounting is refused here, on one line

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation, gradient or compute-copy parameter element."""
        return self.precision.bytes_per_element

    @property
    def state_bytes(self) -> tuple[int, int, int]:
        """Bytes per parameter of (compute parameters, gradients, optimizer states) that this accounting counts at
        this precision (:func:`galva_search.states.state_bytes`)."""
        return state_bytes(self.precision, self.state_accounting)

    def for_strategy(self, strategy: Strategy) -> CostSettings:
        """These settings with what a written strategy fixes (precision, schedule, default dp type, Megatron-SP), so
        the plan is priced as it would run."""
        return replace(
            self,
            precision=strategy.mixed_precision,
            pipeline_schedule=strategy.pipeline_schedule,
            default_dp_type=strategy.default_dp_type,
            megatron_sp=strategy.megatron_sp,
        )
