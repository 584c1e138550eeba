"""``galva-profile check``: run strategies for real and hold galva-search's cost model against what the runtime does.

For each strategy, every rank of a forked gloo world (``galva_comm.testing.run_distributed``) builds its part of the
model with galva-hp (``BuildOptions(measure_activations=True)``), trains ``warmup + steps`` steps on random tokens and
reports, per rank:

* **iteration time**: wall time of ``forward_backward`` (the schedule, the gradient reductions) and of the gradient
  clip and optimizer step (what the cost model prices), the max over ranks per step, then the median over the timed
  steps. The optimizer step is also reported apart.
* **activation bytes** of one micro-batch: the bytes autograd saved in the last step (galva-hp's saved-tensor hooks
  per unit: exact on CPU), divided by the micro-batch count; the largest rank of each stage.
* **model-state bytes**: distinct storages of the rank's parameters (gathered copies included while they exist),
  fp32 masters, gradients (accumulated and sharded) and optimizer states, sampled after every unit's forward, as
  each gradient lands in the backward (a tied weight's copy off its home stage holds one until the step's reduction
  drops it; ZeRO-3's parameters and gradients gathered for the backward are left out there, the prediction's
  transients) and after the backward of the last step; the largest sample, the largest rank of each stage.
* **peak memory**: the process's resident high-water mark (``ru_maxrss``: CPU's equivalent of a device's peak),
  scored against the rank's base plus the predicted peak. The base is measured on the rank before its model is
  built exactly as the hardware profile measures it (:func:`galva_profiler.base_memory.measure_base_memory`: the
  training runtime imported, one small training step, the resident set): the profile's ranks are fresh torchrun
  processes, like galva-train's, while these ranks are forked from this process and share the pages of its
  libraries until they touch them (about 50 MiB less resident here), so the profile's base is shown beside the
  rank's, not added to the rank's peak. The growth over the run's start is shown beside the model terms alone.

The prediction is :func:`galva_search.evaluation.evaluate_strategy` on the same profiles, with its per-stage
breakdown (states, activations of one micro-batch, in-flight count, transients).
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from galva_schema import HardwareProfile, ModelProfile, Strategy

MIB = 2**20


@dataclass(frozen=True)
class CheckOptions:
    steps: int = 3  # timed steps
    warmup: int = 1  # untimed steps first (the optimizer states exist from the first step on)
    seq_length: int = 32
    seed: int = 1234
    timeout_s: float = 600.0
    backward_coefficient: float = 2.0
    decoder_seq_length: int | None = None  # an encoder-decoder's (seq_length is its encoder's)
    span_s: float = 0.0  # the timed steps go on until they span this many seconds (every rank agreeing)


@dataclass
class RankMeasurement:
    rank: int
    stage: int
    forward_backward_ms: list[float]
    optimizer_ms: list[float]
    activation_bytes: int  # saved in the last step, every micro-batch together
    state_bytes: int
    rss_growth_mib: float
    activation_bytes_by_unit: dict[str, int] = field(default_factory=dict)  # per unit: embedding, layers.i, head
    peak_rss_mib: float = 0.0  # the process's resident high-water mark, base included
    base_mib: float = 0.0  # the rank's base before its model, measured as the hardware profile measures it


@dataclass
class StageRow:
    """One line of the table: one stage of one strategy, predicted against measured."""

    strategy: str
    stage: int
    world_size: int
    predicted_time_s: float
    measured_time_s: float
    predicted_states_mib: float
    measured_states_mib: float
    predicted_activation_mib: float  # one micro-batch
    measured_activation_mib: float
    predicted_peak_mib: float  # states + in-flight activations + transients (no framework context)
    measured_rss_growth_mib: float
    in_flight: int
    optimizer_s: float
    predicted_base_mib: float = 0.0  # the hardware profile's measured base memory per process
    measured_peak_rss_mib: float = 0.0  # the process's resident high-water mark (CPU's equivalent of a peak)
    measured_base_mib: float = 0.0  # the ranks' own base, measured as the profile measures it (the largest)

    @property
    def errors(self) -> dict[str, float]:
        return {
            "time": _error(self.predicted_time_s, self.measured_time_s),
            "states": _error(self.predicted_states_mib, self.measured_states_mib),
            "activations": _error(self.predicted_activation_mib, self.measured_activation_mib),
            "peak_vs_rss": _error(self.predicted_peak_mib, self.measured_rss_growth_mib),
            "peak": _error(self.measured_base_mib + self.predicted_peak_mib, self.measured_peak_rss_mib),
            "base": _error(self.predicted_base_mib, self.measured_base_mib),
        }

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "errors": self.errors}


@dataclass
class StrategyCheck:
    name: str
    strategy: Strategy
    ranks: list[RankMeasurement] = field(default_factory=list)
    rows: list[StageRow] = field(default_factory=list)

    def _per_step_ms(self) -> list[float]:
        """Per timed step, the slowest rank's forward-backward and optimizer step (the cost model prices both)."""
        steps = range(len(self.ranks[0].forward_backward_ms))
        return [max(r.forward_backward_ms[i] + r.optimizer_ms[i] for r in self.ranks) for i in steps]

    @property
    def measured_time_s(self) -> float:
        per_step = self._per_step_ms()
        return statistics.median(per_step) * 1e-3

    @property
    def time_spread_s(self) -> float:
        """Half the range of the per-step times: the measured noise."""
        per_step = self._per_step_ms()
        return (max(per_step) - min(per_step)) * 0.5e-3


def _error(predicted: float, measured: float) -> float:
    """Relative error of the prediction, (predicted - measured) / measured (0 when both are 0)."""
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return (predicted - measured) / measured


# ------------------------------------------------------------------------------------------------------ running
def _state_bytes(model: Any, optimizer: Any, gathered: bool = True) -> int:
    """Bytes of the distinct storages holding this rank's model states right now; ``gathered``: with the full
    parameters and gradients a sharded unit holds while it computes."""
    import torch

    from galva_hp.data_parallel import FsdpUnit, local_tensor

    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = local_tensor(t).untyped_storage()
        if storage.nbytes() and storage.data_ptr():
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())

    sharded = [fp for unit in model.units if isinstance(unit, FsdpUnit) for fp in _fsdp_params(unit)]
    # a sharded unit's module holds its full parameters while it computes
    full = set() if gathered else {id(fp._unsharded_param) for fp in sharded if hasattr(fp, "_unsharded_param")}
    for p in model.parameters():
        if id(p) not in full:
            add(p)
            add(p.grad)
    for unit in model.units:
        for _, master in unit.master_parameters():  # fp32: the parameters themselves
            if id(master) not in full:
                add(master)
                add(master.grad)
    for fp in sharded:
        add(fp.sharded_param)
        add(fp.sharded_param.grad)
        add(getattr(fp, "unsharded_accumulated_grad", None))
        if gathered and getattr(fp, "_unsharded_param", None) is not None:
            add(fp._unsharded_param)
            add(fp._unsharded_param.grad)
    for state in optimizer.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                add(value)
    return sum(seen.values())


def _fsdp_params(unit: Any) -> list[Any]:
    """The FSDP parameters of a ZeRO unit (torch's per-parameter records: sharded and, while gathered, full)."""
    group = unit.fsdp._get_fsdp_state()._fsdp_param_group
    return list(group.fsdp_params) if group is not None else []


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / MIB


def _run_rank(rank: int, world: int, config: Any, strategy: Strategy, options: CheckOptions) -> RankMeasurement:
    import torch

    from galva_hp import BuildOptions, GalvaOptimizer, OptimConfig, build
    from galva_models.tables.family import length_options
    from galva_models.tables.registry import adapter_for
    from galva_profiler.base_memory import measure_base_memory
    from galva_profiler.distributed import World

    cpu = World(rank, world, rank, world, "gloo", torch.device("cpu"))
    base_mib = measure_base_memory(cpu)  # what the profile's base measures, in this (forked) process
    base_rss = _rss_mib()
    adapter = adapter_for(config)
    torch.manual_seed(options.seed)
    hf_model = adapter.build_model(config, attn_implementation="sdpa")
    build_options = BuildOptions(seq_len=options.seq_length, measure_activations=True)
    lengths = length_options(adapter.task, options.seq_length, options.decoder_seq_length)
    model = build(adapter.decompose(hf_model, **lengths), strategy, build_options)
    del hf_model
    optimizer = GalvaOptimizer(model.param_records(), OptimConfig(lr=1e-4))
    source = _batch_source(config, adapter, strategy.global_batch_size, options)
    sampling = {"on": False, "max": 0}

    def sample(*_: Any, gathered: bool = True) -> None:
        if sampling["on"]:
            sampling["max"] = max(sampling["max"], _state_bytes(model, optimizer, gathered))

    for unit in model.units:
        unit.module.register_forward_hook(sample)
    measuring, timing = model.options, replace(model.options, measure_activations=False)
    fb_ms: list[float] = []
    opt_ms: list[float] = []

    def train(step: int, last: bool) -> tuple[float, float]:
        """One step; (forward_backward, clip + optimizer step) ms. ``last`` measures bytes (hooks cost time)."""
        model.options = measuring if last else timing
        sampling["on"] = last
        batch = source.batch(step)
        optimizer.zero_grad()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        model.forward_backward(batch.inputs, batch.labels)
        t1 = time.perf_counter()
        sample()
        optimizer.clip_grad_norm()
        optimizer.step()
        model.after_step()
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    for step in range(options.warmup):
        train(step, False)
    start = time.perf_counter()
    while _more_steps(len(fb_ms) < options.steps or time.perf_counter() - start < options.span_s):
        fb, opt = train(options.warmup + len(fb_ms), False)
        fb_ms.append(fb)
        opt_ms.append(opt)
    for param in model.parameters():  # the measuring step only: the timed ones carry no per-gradient hook
        if param.requires_grad:  # a copy's gradient is gone by the backward's end: sample as each one lands
            param.register_post_accumulate_grad_hook(lambda _: sample(gathered=False))
    train(options.warmup + len(fb_ms), True)
    by_unit = dict(model.saved_bytes)
    activation_bytes = sum(by_unit.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return RankMeasurement(
        rank, model.stage, fb_ms, opt_ms, activation_bytes, sampling["max"], peak - base_rss, by_unit, peak, base_mib
    )


def _more_steps(wanted: bool) -> bool:
    """Whether any rank wants another timed step (collective: every rank then takes it, none waits alone)."""
    import torch

    flag = torch.tensor([1.0 if wanted else 0.0])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def _batch_source(config: Any, adapter: Any, batch: int, options: CheckOptions) -> Any:
    """Random batches of the model's task, as galva-train's: next or masked tokens, an encoder-decoder's
    ``[encoder ; decoder]`` ids, or images and labels."""
    from galva_models.data import random_source

    task = adapter.task.value
    return random_source(task, config, options.seq_length, batch, options.seed, options.decoder_seq_length)


def measure(config: Any, strategy: Strategy, options: CheckOptions) -> list[RankMeasurement]:
    """Run ``strategy`` on ``strategy.world_size`` forked gloo ranks and measure every rank."""
    from galva_comm.testing import run_distributed
    from galva_profiler.base_memory import import_runtime

    import_runtime()  # once here, not in every forked rank (their base counts it either way)
    return list(run_distributed(_run_rank, strategy.world_size, config, strategy, options, timeout=options.timeout_s))


# ------------------------------------------------------------------------------------------------------ comparing
def predict(
    hardware: HardwareProfile, model: ModelProfile, strategy: Strategy, options: CheckOptions, factors: Any = None
) -> Any:
    """galva-search's evaluation of ``strategy`` (no framework context: the check compares tensors)."""
    from galva_search.cost_model import CostModel, CostSettings, TermFactors
    from galva_search.evaluation import evaluate_strategy

    settings = CostSettings(
        context_mib=0.0,
        backward_coefficient=options.backward_coefficient,
        factors=factors or TermFactors(),
        state_accounting="galva-hp",
    )
    return evaluate_strategy(CostModel(hardware, model, settings), strategy)


def compare(check: StrategyCheck, hardware: HardwareProfile, model: ModelProfile, options: CheckOptions) -> None:
    """Fill ``check.rows``: one row per stage."""
    evaluation = predict(hardware, model, check.strategy, options)
    detail = evaluation.detail
    c = check.strategy.num_micro_batches
    check.rows = []
    for stage in range(check.strategy.pp):
        ranks = [r for r in check.ranks if r.stage == stage]
        check.rows.append(
            StageRow(
                strategy=check.name,
                stage=stage,
                world_size=check.strategy.world_size,
                predicted_time_s=evaluation.iteration_time_s,
                measured_time_s=check.measured_time_s,
                predicted_states_mib=detail.stage_states_mib[stage],
                measured_states_mib=max(r.state_bytes for r in ranks) / MIB,
                predicted_activation_mib=detail.stage_activation_mib[stage],
                measured_activation_mib=max(r.activation_bytes for r in ranks) / c / MIB,
                predicted_peak_mib=detail.stage_memory_mib[stage],
                measured_rss_growth_mib=max(r.rss_growth_mib for r in ranks),
                in_flight=detail.stage_in_flight[stage],
                optimizer_s=statistics.median(
                    max(r.optimizer_ms[i] for r in ranks) for i in range(len(ranks[0].optimizer_ms))
                )
                * 1e-3,
                predicted_base_mib=hardware.base_memory_mib or 0.0,
                measured_peak_rss_mib=max(r.peak_rss_mib for r in ranks),
                measured_base_mib=max(r.base_mib for r in ranks),
            )
        )


def table(rows: list[StageRow]) -> str:
    """Markdown table: predicted vs measured per strategy and stage, with relative errors."""
    head = (
        "| strategy | ranks | stage | time pred / meas (ms) | err | states pred / meas (MiB) | err "
        "| act/mb pred / meas (MiB) | err | peak pred / meas (MiB) | err | base profile / rank (MiB) "
        "| model terms (MiB) / RSS growth |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        e = r.errors
        lines.append(
            f"| {r.strategy} | {r.world_size} | {r.stage} "
            f"| {r.predicted_time_s * 1e3:.1f} / {r.measured_time_s * 1e3:.1f} "
            f"| {e['time']:+.1%} | {r.predicted_states_mib:.4f} / {r.measured_states_mib:.4f} | {e['states']:+.2%} "
            f"| {r.predicted_activation_mib:.4f} / {r.measured_activation_mib:.4f} | {e['activations']:+.2%} "
            f"| {r.measured_base_mib + r.predicted_peak_mib:.1f} / {r.measured_peak_rss_mib:.1f} | {e['peak']:+.1%} "
            f"| {r.predicted_base_mib:.1f} / {r.measured_base_mib:.1f} "
            f"| {r.predicted_peak_mib:.2f} / {r.measured_rss_growth_mib:.1f} |"
        )
    return head + "\n".join(lines) + "\n"


def report(checks: list[StrategyCheck], calibration: Any = None) -> dict[str, Any]:
    """The JSON of a check: every row with its errors, per strategy the per-rank raw measurements."""
    rows = [row for check in checks for row in check.rows]
    abs_time = sorted(abs(r.errors["time"]) for r in rows)
    return {
        "kind": "galva.check_report",
        "strategies": [
            {
                "name": check.name,
                "strategy": check.strategy.to_dict(),
                "measured_time_s": check.measured_time_s,
                "time_spread_s": check.time_spread_s,
                "ranks": [asdict(r) for r in check.ranks],
            }
            for check in checks
        ],
        "rows": [r.to_dict() for r in rows],
        "summary": {
            "median_abs_time_error": statistics.median(abs_time) if abs_time else None,
            "max_abs_states_error": max((abs(r.errors["states"]) for r in rows), default=None),
            "max_abs_activation_error": max((abs(r.errors["activations"]) for r in rows), default=None),
            "max_abs_time_error": abs_time[-1] if abs_time else None,
            "max_abs_peak_error": max((abs(r.errors["peak"]) for r in rows), default=None),
            # the profile's base (a fresh torchrun process) against the forked ranks': shown, not scored
            "max_abs_base_error": max((abs(r.errors["base"]) for r in rows), default=None),
        },
        "calibration": calibration.to_dict() if calibration is not None else None,
    }
