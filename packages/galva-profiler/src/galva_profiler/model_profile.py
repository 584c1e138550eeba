"""The model sweep: per layer type and sequence length, time over batch sizes and activations per degree; then the
vocabulary modules; then one validated :class:`galva_schema.ModelProfile` per sequence length.

Time forms (``forward_time`` of the profile; every form's fit and residuals are in the report either way):

* ``static``: ms per sample at the largest profiled batch;
* ``batch``: the least-squares line ``slope * b + intercept`` through the forward ms at every profiled batch;
* ``sequence``: the quadratic ``a s^2 + b s + c`` through the ms per sample (largest batch) at every profiled length
  (3 lengths or more).

Backward time is measured the same way and reported (with its ratio to forward, which is galva-search's
``--backward-coefficient``); the profile format has no backward field, the search models backward from forward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from galva_profiler.activation_memory import LayerActivations, measure_layer
from galva_profiler.attention_core import measure_attention_core
from galva_profiler.errors import ProfileError
from galva_profiler.experts import experts_module, measure_experts, time_experts
from galva_profiler.fitting import Fit, alpha_beta, quadratic
from galva_profiler.layer_step import StepCost, step_cost
from galva_profiler.layer_timing import (
    PassTimes,
    layer_forward,
    on_device,
    split_backward_overhead_share,
    time_interleaved,
    time_passes,
    weight_grad_share,
)
from galva_profiler.model_source import MetaModel
from galva_profiler.progress import Progress
from galva_profiler.reference_speed import ReferenceClock
from galva_profiler.routing import routing_by_layer
from galva_profiler.timing import TIMING_SPAN_S, Repeats
from galva_profiler.vocab import POSITIONS, VocabInputs, VocabMeasurement, tie, vocab_memory, vocab_times
from galva_schema import (
    AttentionCoreProfile,
    BatchTime,
    ExpertProfile,
    LayerTypeProfile,
    ModelProfile,
    Precision,
    SequenceTime,
    StaticTime,
    VocabMemory,
    VocabProfile,
)

TimeForm = Literal["static", "batch", "sequence"]
DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
MIB = 2**20


MAX_TP = 128
"""Largest tp degree the sweep measures: the measured degrees are the powers of two up to ``--max-tp``."""


@dataclass(frozen=True)
class ModelSweepOptions:
    seq_lengths: tuple[int, ...]
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_tp: int = 8
    precision: Precision = Precision.FP32
    megatron_sp: bool = False
    time_form: TimeForm = "batch"
    repeats: Repeats = field(default_factory=lambda: Repeats(warmup=2, repetitions=5))
    timeout_s: float = 300.0
    timing_span_s: float = TIMING_SPAN_S  # a layer's timed passes span this many seconds at least (time_interleaved)
    device: str = "cpu"  # where the layers, attention cores, vocabulary modules and optimizer steps are timed

    def __post_init__(self) -> None:
        if self.max_tp < 1 or self.max_tp > MAX_TP or self.max_tp & (self.max_tp - 1):
            raise ProfileError(
                f"--max-tp {self.max_tp}: expected a power of two from 1 to {MAX_TP} (the sweep measures the tp, "
                f"Ulysses and vocab tp degrees 1, 2, 4, ... up to it)"
            )
        if self.timing_span_s < 0:
            raise ProfileError(f"--timing-span must be >= 0 seconds, got {self.timing_span_s:g}")
        if self.time_form == "batch" and len(set(self.batch_sizes)) < 2:
            raise ProfileError("--time-form batch needs 2 or more --batch-sizes")
        if self.time_form == "sequence" and len(set(self.seq_lengths)) < 3:
            raise ProfileError("--time-form sequence needs 3 or more --seq-lengths (a quadratic fit)")


@dataclass
class LayerMeasurement:
    name: str
    first_index: int
    num_layers: int
    hidden: int
    parameter_bytes: int
    times: dict[int, dict[int, PassTimes]] = field(default_factory=dict)  # seq -> batch -> times
    activations: dict[int, LayerActivations] = field(default_factory=dict)  # seq -> measurement
    weight_grad_share: dict[int, float] = field(default_factory=dict)  # seq -> share of backward (zb-h1's W)
    split_overhead_ms: dict[int, float] = field(default_factory=dict)  # seq -> zb-h1's split cost per call
    experts: dict[int, ExpertProfile] = field(default_factory=dict)  # seq -> routed experts (MoE layer types)
    attention_core: AttentionCoreProfile | None = None  # over every profiled length at once
    step: StepCost | None = None  # galva-hp's optimizer step over the layer's tensors


@dataclass
class ModelSweep:
    """Everything measured for one model."""

    model: MetaModel
    options: ModelSweepOptions
    layers: list[LayerMeasurement]
    vocab: dict[int, VocabMeasurement]  # seq -> measurement
    degrees: dict[str, list[int]]
    vocab_degrees: list[int]
    vocab_step: StepCost | None = None  # the vocabulary layers' optimizer step, as a layer's
    reference_ms: float | None = None  # the reference matmul, sampled between the layers' timed rounds

    def batch_fit(self, times: dict[int, PassTimes], backward: bool = False) -> Fit:
        batches = sorted(times)
        return alpha_beta(batches, [times[b].backward_ms if backward else times[b].forward_ms for b in batches])

    def sequence_fit(self, per_seq: dict[int, dict[int, PassTimes]]) -> Fit | None:
        if len(per_seq) < 3:
            return None
        seqs = sorted(per_seq)
        return quadratic(seqs, [_ms_per_sample(per_seq[s]) for s in seqs])


def _ms_per_sample(times: dict[int, PassTimes]) -> float:
    largest = max(times)
    return times[largest].forward_ms / largest


def degrees_for(model: MetaModel, max_tp: int, seq_lengths: tuple[int, ...]) -> tuple[dict[str, list[int]], list[int]]:
    """Degrees per mode (tp, megatron_sp, ulysses) every layer type can run, and the vocabulary tp degrees.

    A degree is kept when the model's constraints allow the form and the heads split (galva-schema's rule) and,
    for the sequence-splitting forms, when it divides the tokens every layer type passes at every profiled length
    (the constraints' ``seq_length`` where a type states its own, as an encoder-decoder's ``[encoder ; decoder]``).
    """
    from galva_schema import ParallelForm
    from galva_schema.constraints import supported_degrees

    constraints = model.constraints(seq_lengths[0])
    tokens = [t.seq_length or s for s in seq_lengths for t in model.constraints(s).layer_types]
    candidates = [2**i for i in range(MAX_TP.bit_length()) if 2**i <= max_tp]
    out: dict[str, list[int]] = {}
    for mode, form, ulysses in (
        ("tp", ParallelForm.TP, False),
        ("megatron_sp", ParallelForm.MEGATRON_SP, False),
        ("ulysses", ParallelForm.ULYSSES, True),
    ):
        kept = candidates
        for layer_type in constraints.layer_types:
            if form in layer_type.unsupported or (
                form is ParallelForm.MEGATRON_SP and ParallelForm.TP in layer_type.unsupported
            ):
                kept = [1]
            kept = [d for d in kept if d in supported_degrees(layer_type, kept, ulysses)]
        if mode != "tp":
            kept = [d for d in kept if all(n % d == 0 for n in tokens)]
        out[mode] = kept
    vocab = [1] if ParallelForm.VOCAB_TP in constraints.vocab_unsupported else candidates
    return out, vocab


RETIMES = 2
"""Extra timings of a layer whose forward time does not grow with the batch (see :func:`unsteady_timing`)."""


def unsteady_timing(times: dict[int, PassTimes]) -> str | None:
    """Why per-batch forward and backward times cannot be a layer's (None if they can): more samples never take less
    time, so a fitted slope below zero means the timings caught outside load, not the layer (the profile keeps both
    passes' fits since the cost model prices the backward from its own)."""
    if len(times) < 2:
        return None
    batches = sorted(times)
    for name, ms in (
        ("forward", [times[b].forward_ms for b in batches]),
        ("backward", [times[b].backward_ms for b in batches]),
    ):
        slope, _ = alpha_beta(batches, ms).coefficients
        if slope < 0:
            return f"{name} time falls with the batch size ({slope:.3f} ms per sample)"
    return None
    slope, _ = alpha_beta(sorted(times), [times[b].forward_ms for b in sorted(times)]).coefficients
    if slope < 0:
        return f"forward time falls with the batch size ({slope:.3f} ms per sample)"
    return None


def run_model_sweep(model: MetaModel, options: ModelSweepOptions, progress_enabled: bool = True) -> ModelSweep:
    """Measure every layer type (its first layer only) and the vocabulary modules: their times on
    ``options.device``, their bytes on CPU (first, in a process of their own, where this one sees a GPU)."""
    dtype = DTYPES[options.precision]
    degrees, vocab_degrees = degrees_for(model, options.max_tp, options.seq_lengths)
    runs = model.layer_runs()
    seqs, batches = sorted(set(options.seq_lengths)), sorted(set(options.batch_sizes))
    total = len(seqs) * (len(runs) * 2 + 1)
    progress = Progress(total, f"model {model.name}", enabled=progress_enabled)
    layers = _layer_measurements(model, dtype, seqs[0])
    vocab_modules = torch.nn.ModuleList([model.embedding(dtype).train(), model.head(dtype).train()])
    tie(model.layered)
    # a GPU machine measures the bytes first, in a process that sees no GPU (_bytes_in_a_cpu_process); elsewhere
    # each layer's bytes follow its times, in this process
    elsewhere = _bytes_in_a_cpu_process()
    vocab = _measure_bytes_in_a_cpu_process(model, layers, options) if elsewhere else {}
    device = _device(options)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # autograd's device threads run the backward's kernels in its context
    reference = ReferenceClock(device)
    for seq in seqs:
        specs = layer_specs(model.at_length(seq), seq)
        for measurement in layers:
            module = model.layer(measurement.first_index, dtype)
            _time_layer(module, measurement, seq, specs, batches, options, progress, reference)
            if device.type != "cpu":  # on CPU they were timed with the bytes
                _time_experts(model, measurement, seq, options)
            if not elsewhere:
                _layer_bytes(model, measurement, seq, specs, degrees, options)
            progress.step(f"{measurement.name} seq {seq} activations (tp {degrees['tp']})")
    _measure_cores(model, layers, seqs, batches[-1], dtype, options.repeats, device)
    vocab_step = step_cost(vocab_modules, options.repeats, device)  # a tied weight once, as galva-hp's home record
    for seq in seqs:
        times = vocab_times(
            model.at_length(seq).layered, _vocab_inputs(model, seq, dtype), dtype, batches, options.repeats,
            options.timing_span_s, device,
        )  # fmt: skip
        if not elsewhere:
            vocab[seq] = _vocab_bytes(model, layers, seq, vocab_degrees, options)
        vocab[seq].times = times
        progress.step(f"vocabulary seq {seq}")
    return ModelSweep(model, options, layers, vocab, degrees, vocab_degrees, vocab_step, reference.median_ms())


def _device(options: ModelSweepOptions) -> torch.device:
    """Where the sweep times: ``options.device``, a GPU with its index (the current one where none is named)."""
    device = torch.device(options.device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _layer_measurements(model: MetaModel, dtype: torch.dtype, seq: int) -> list[LayerMeasurement]:
    """One measurement per run of layers of one type, its first layer made real."""
    specs = layer_specs(model.at_length(seq), seq)
    layers = []
    for kind, first, count in model.layer_runs():
        module = model.layer(first, dtype).train()
        parameter_bytes = sum(p.numel() for p in module.parameters()) * 4  # fp32 bytes, as the profile states
        layers.append(LayerMeasurement(kind, first, count, specs[first].hidden_size, parameter_bytes))
    return layers


def _measure_bytes(
    model: MetaModel, layers: list[LayerMeasurement], options: ModelSweepOptions
) -> dict[int, VocabMeasurement]:
    """Each layer type's activations (and experts) at every length and degree, and the vocabulary's bytes at every
    length and vocabulary degree, on CPU (forked ranks for the degrees above 1); the vocabulary's returned."""
    degrees, vocab_degrees = degrees_for(model, options.max_tp, options.seq_lengths)
    vocab: dict[int, VocabMeasurement] = {}
    for seq in sorted(set(options.seq_lengths)):
        specs = layer_specs(model.at_length(seq), seq)
        for measurement in layers:
            _layer_bytes(model, measurement, seq, specs, degrees, options)
        vocab[seq] = _vocab_bytes(model, layers, seq, vocab_degrees, options)
    return vocab


def _layer_bytes(
    model: MetaModel,
    measurement: LayerMeasurement,
    seq: int,
    specs: list[Any],
    degrees: dict[str, list[int]],
    options: ModelSweepOptions,
) -> None:
    """One layer type's activations at ``seq`` at ``degrees`` (forked ranks above 1), and its experts if any."""
    dtype = DTYPES[options.precision]
    module = model.layer(measurement.first_index, dtype)
    layer_seq = specs[measurement.first_index].seq_length
    measurement.activations[seq] = measure_layer(
        module, measurement.name, model.layered.parallelizer, layer_seq, measurement.hidden, dtype, degrees,
        options.timeout_s,
    )  # fmt: skip
    batches = sorted(set(options.batch_sizes))
    profiled = _experts_of(model, measurement, module, seq, batches, dtype, options)
    if profiled is not None:
        measurement.experts[seq] = profiled


def _vocab_bytes(
    model: MetaModel, layers: list[LayerMeasurement], seq: int, vocab_degrees: list[int], options: ModelSweepOptions
) -> VocabMeasurement:
    """The vocabulary's states and activation bytes at ``seq`` at ``vocab_degrees`` (forked ranks above 1)."""
    dtype = DTYPES[options.precision]
    return vocab_memory(
        model.at_length(seq).layered, _vocab_inputs(model, seq, dtype), layers[0].hidden, dtype, vocab_degrees,
        options.megatron_sp, options.timeout_s,
    )  # fmt: skip


def _bytes_in_a_cpu_process() -> bool:
    """Whether the bytes are measured in a process of their own that sees no GPU: where this one sees one. Once
    autograd has run here (the model's own analysis runs a backward), it holds a thread per GPU, and a rank forked
    from it cannot run a backward (torch: "Unable to handle autograd's threading in combination with fork-based
    multiprocessing"); a process that sees no GPU starts no such threads."""
    return torch.cuda.is_available()


def _measure_bytes_in_a_cpu_process(
    model: MetaModel, layers: list[LayerMeasurement], options: ModelSweepOptions
) -> dict[int, VocabMeasurement]:
    """:func:`_measure_bytes` in a spawned process with ``CUDA_VISIBLE_DEVICES`` empty (the same model rebuilt from
    its config and seed); its results go into ``layers`` and the vocabulary's are returned. A failure there is
    :class:`ProfileError` with its first line."""
    import multiprocessing as mp
    import os

    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    build = (model.config, model.name, model.seed, model.seq_length, model.decoder_seq_length)
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the spawned interpreter reads it at its start
    try:
        process = ctx.Process(target=_bytes_worker, args=(sender, build, options), name="galva-profile-bytes")
        process.start()
    finally:
        if hidden is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    sender.close()
    try:
        kind, payload = receiver.recv()
    except EOFError:  # it ended without a word (killed)
        process.join(5.0)
        kind, payload = "error", f"it ended with exit code {process.exitcode}"
    except BaseException:  # interrupted here (a signal to this process alone): it must not go on by itself
        process.terminate()
        raise
    finally:
        process.join()
    if kind == "error":
        raise ProfileError(f"measuring activation bytes in a CPU process: {payload}")
    activations, experts, vocab = payload
    for measurement in layers:
        measurement.activations = activations[measurement.first_index]
        measurement.experts = experts[measurement.first_index]
    return vocab


def _bytes_worker(sender: Any, build: tuple[Any, str, int, int | None, int | None], options: ModelSweepOptions) -> None:
    """The spawned side of :func:`_measure_bytes_in_a_cpu_process`: ``("ok", (activations, experts, vocab))`` by
    layer's first index, or ``("error", first line)``."""
    try:
        config, name, seed, seq_length, decoder_seq_length = build
        model = MetaModel.build(config, name, seed, seq_length=seq_length, decoder_seq_length=decoder_seq_length)
        dtype = DTYPES[options.precision]
        layers = _layer_measurements(model, dtype, sorted(set(options.seq_lengths))[0])
        model.embedding(dtype).train()
        model.head(dtype).train()
        tie(model.layered)
        vocab = _measure_bytes(model, layers, options)
        sender.send(
            ("ok", ({m.first_index: m.activations for m in layers}, {m.first_index: m.experts for m in layers}, vocab))
        )
    except BaseException as err:  # whatever it was, the parent says it in one line
        sender.send(("error", (str(err).splitlines() or [type(err).__name__])[0]))
    finally:
        sender.close()


def _time_layer(
    module: torch.nn.Module,
    measurement: LayerMeasurement,
    seq: int,
    specs: list[Any],
    batches: list[int],
    options: ModelSweepOptions,
    progress: Progress,
    reference: ReferenceClock | None = None,
) -> None:
    """The layer's passes over ``batches``, its optimizer step (then a ``progress`` step), its weight-gradient share
    and its split backward's overhead, on ``options.device`` (the module goes there and comes back); ``reference``
    sampled between the passes' rounds."""
    device, dtype = _device(options), DTYPES[options.precision]
    layer_seq, hidden, repeats = specs[measurement.first_index].seq_length, measurement.hidden, options.repeats
    with on_device(device, module):
        # one untimed pass at the largest size first: allocator and kernel choice settle before any timing
        time_passes(layer_forward(module, batches[-1], layer_seq, hidden, dtype, device), Repeats(0, 1), device)
        measurement.times[seq] = _time_batches(module, batches, layer_seq, hidden, dtype, options, reference)
        if measurement.step is None:  # the tensors do not depend on the sequence length
            measurement.step = step_cost(module, repeats, device)
        progress.step(f"{measurement.name} seq {seq} batches {','.join(map(str, batches))}")
        measurement.weight_grad_share[seq] = weight_grad_share(
            module, batches[-1], layer_seq, hidden, dtype, repeats, device
        )
        split_share = split_backward_overhead_share(module, batches[-1], layer_seq, hidden, dtype, repeats, device)
        for _ in range(RETIMES):
            problem = unsteady_timing(measurement.times[seq])
            if problem is None:
                break
            # outside load caught the rounds unevenly all the same: time them all again
            measurement.times[seq] = _time_batches(module, batches, layer_seq, hidden, dtype, options, reference)
        else:
            problem = unsteady_timing(measurement.times[seq])
            if problem is not None:
                print(
                    f"galva-profile: warning: {measurement.name} at sequence {seq}: {problem} after "
                    f"{RETIMES + 1} timings; was the machine busy? The profile keeps the last one",
                    file=sys.stderr,
                    flush=True,
                )
        # on the backward the profile keeps, in its clock (layer_timing.split_backward_overhead_share)
        measurement.split_overhead_ms[seq] = split_share * measurement.times[seq][batches[-1]].backward_ms


def _time_batches(
    module: torch.nn.Module,
    batches: list[int],
    seq: int,
    hidden: int,
    dtype: torch.dtype,
    options: ModelSweepOptions,
    reference: ReferenceClock | None = None,
) -> dict[int, PassTimes]:
    """The layer at every batch size, interleaved (:func:`time_interleaved`), on ``options.device``."""
    device = _device(options)
    runs = {batch: layer_forward(module, batch, seq, hidden, dtype, device) for batch in batches}
    sample = None if reference is None else reference.sample
    return time_interleaved(runs, options.repeats, device, span_s=options.timing_span_s, after_round=sample)


def _vocab_inputs(model: MetaModel, seq: int, dtype: torch.dtype) -> VocabInputs:
    """The vocabulary modules' inputs at ``seq``; the head reads the last layer's shape where layers change it
    (a shape-keeping last layer, as Swin's last stage has no patch merging)."""
    specs = layer_specs(model, seq)
    first, last = specs[0], specs[-1]
    changed = (last.seq_length, last.hidden_size) != (first.seq_length, first.hidden_size)
    head_input = (last.seq_length, last.hidden_size) if changed else None
    decoder = model.decoder_length(seq)
    if decoder is not None:  # an encoder-decoder embeds [encoder ; decoder] ids and scores the decoder's tokens
        return VocabInputs.of(model.config, first.seq_length, dtype, False, head_input, decoder)
    return VocabInputs.of(model.config, seq, dtype, _reads_images(model), head_input)


def _reads_images(model: MetaModel) -> bool:
    """Whether the model's task (its adapter's) feeds images and a label per sample, not tokens."""
    return getattr(model.adapter, "task", None) is not None and model.adapter.task.value == "image_classification"


ROUTING_FORWARDS = 32
"""Forwards whose routing gives the measured imbalance (the mean of their figures; on tiny Mixtral 8 forwards gave
ep 4 a summed figure of 1.221, 32 forwards 1.200)."""


def _experts_of(
    model: MetaModel, m: LayerMeasurement, module: Any, seq: int, batches: list[int], dtype: torch.dtype,
    options: ModelSweepOptions,
) -> ExpertProfile | None:  # fmt: skip
    """The routed experts of a mixture-of-experts layer type (None for a dense one), its layers' routing measured on
    :data:`ROUTING_FORWARDS` batches of random tokens (the largest profiled batch) run through the model."""
    parts = _expert_parts(model, module)
    if parts is None:
        return None
    found, block, router = parts
    own = model.constraints(seq).layer_types[[r[1] for r in model.layer_runs()].index(m.first_index)]
    routed = routing_by_layer(model, found[0], seq, batches[-1], ROUTING_FORWARDS, dtype, model.seed)
    kinds = model.layered.layer_types
    mine = {i: c for i, c in routed.items() if kinds[i] == kinds[m.first_index]}  # this type's layers only
    return measure_experts(
        found, block, router, model.config, own.expert_ffn or 1, mine, dtype, options.repeats, options.timeout_s
    )


def _expert_parts(
    model: MetaModel, module: Any
) -> tuple[tuple[str, torch.nn.Module], torch.nn.Module, type[torch.nn.Module] | None] | None:
    """``((path, experts module), the block holding it, the family's router class)`` of a layer (None: dense)."""
    parallelizer = model.layered.parallelizer
    found = experts_module(module, getattr(getattr(parallelizer, "tables", None), "ep", None) or {})
    if found is None:
        return None
    from galva_models.tables.router import router_class

    inner = getattr(module, "layer", module)
    block_path = found[0].rpartition(".")[0]
    block = inner.get_submodule(block_path) if block_path else inner
    base = model.hf_model.base_model
    router = router_class(base) if isinstance(base, torch.nn.Module) else None
    return found, block, router[0] if router else None


def _time_experts(model: MetaModel, m: LayerMeasurement, seq: int, options: ModelSweepOptions) -> None:
    """The experts' and the router's times of ``m`` at ``seq`` again, on ``options.device`` (its bytes and routing
    were measured on CPU)."""
    profiled = m.experts.get(seq)
    parts = _expert_parts(model, model.layer(m.first_index, DTYPES[options.precision]))
    if profiled is None or parts is None:
        return
    (_, experts), block, router = parts
    expert_time, router_ms = time_experts(
        experts, block, router, int(model.config.hidden_size), DTYPES[options.precision], options.repeats,
        _device(options),
    )  # fmt: skip
    m.experts[seq] = profiled.model_copy(update={"expert_time": expert_time, "router_ms_per_token": router_ms})


def _measure_cores(
    model: MetaModel,
    layers: list[LayerMeasurement],
    seqs: list[int],
    batch: int,
    dtype: torch.dtype,
    repeats: Repeats,
    device: torch.device,
) -> None:
    """Each layer type's attention core over the profiled lengths (heads from the model's constraints; causal for
    a causal LM); none for a layer type without attention heads in them."""
    constraints = model.constraints(seqs[0])
    heads = {t.name: t for t in constraints.layer_types}
    causal = getattr(model.adapter, "task", None) is not None and model.adapter.task.value == "causal_lm"
    for m in layers:
        own = heads.get(m.name)
        if own is None:
            continue
        head_dim = getattr(model.config, "head_dim", None) or m.hidden // own.num_heads
        core = measure_attention_core(
            own.num_heads, own.kv_heads, head_dim, causal, tuple(seqs), batch, dtype, repeats, device
        )
        window, count = _windows(model, m.first_index)
        m.attention_core = core.model_copy(update={"window": window, "window_layers": count}) if count else core


def _windows(model: MetaModel, first_index: int) -> tuple[int | None, int]:
    """``(window, how many layers use it)`` over the layers of ``first_index``'s type: the family's own per-layer
    ``sliding_window`` attribute (an attention module's, e.g. Gemma 2's alternating layers), else the config's
    (families that hand the config's window to every attention call, e.g. Mistral); the largest when they differ."""
    kinds = model.layered.layer_types
    found: list[int] = []
    for index, layer in enumerate(model.layered.layers):
        if kinds[index] != kinds[first_index]:
            continue
        owners = [mod for mod in layer.modules() if hasattr(mod, "sliding_window")]
        window = owners[0].sliding_window if owners else getattr(model.config, "sliding_window", None)
        if isinstance(window, int) and window > 0:
            found.append(window)
    return (max(found), len(found)) if found else (None, 0)


def layer_specs(model: MetaModel, seq: int) -> list[Any]:
    """The adapter's spec of every layer at sequence length ``seq`` (hidden size, heads, ...; an encoder-decoder's
    boundary carries both streams)."""
    decoder = model.decoder_length(seq)
    try:
        if decoder is not None:
            return list(model.adapter.layer_specs(model.config, seq, decoder))
        return list(model.adapter.layer_specs(model.config, seq))
    except ValueError as err:
        raise ProfileError(f"{model.name}: {err}") from None


def _forward_time(sweep: ModelSweep, per_seq: dict[int, dict[int, PassTimes]], seq: int, backward: bool = False) -> Any:
    """The profile's time model of the forward (or, ``backward``, the backward) in the sweep's form."""
    form = sweep.options.time_form
    if backward:  # the backward's times in the forward's place: one fitting path for both
        per_seq = {s: {b: PassTimes(t.backward_ms, t.backward_ms) for b, t in ts.items()} for s, ts in per_seq.items()}
    if form == "static":
        largest = max(per_seq[seq])
        return StaticTime(ms_per_sample=per_seq[seq][largest].forward_ms / largest, batch_size=largest)
    if form == "batch":
        slope, intercept = sweep.batch_fit(per_seq[seq]).coefficients
        return BatchTime(slope_ms_per_sample=max(0.0, slope), intercept_ms=intercept)
    fit = sweep.sequence_fit(per_seq)
    assert fit is not None  # ModelSweepOptions refuses the sequence form with fewer than 3 lengths
    a, b, c = fit.coefficients
    return SequenceTime(coefficients=(a, b, c))


def _per_degree(acts: LayerActivations, mode: str) -> dict[int, float]:
    """MiB per sample of ``mode`` at every measured degree above 1 (degree 1 is the plain layer, in the tp table)."""
    return {d: b / MIB for d, b in acts.bytes_per_sample.get(mode, {}).items() if d > 1}


def model_profiles(sweep: ModelSweep) -> dict[int, ModelProfile]:
    """One validated ModelProfile per profiled sequence length."""
    options = sweep.options
    act_mode = "megatron_sp" if options.megatron_sp else "tp"
    profiles = {}
    for seq in sorted(set(options.seq_lengths)):
        layer_types = []
        for m in sweep.layers:
            acts = m.activations[seq]
            layer_types.append(
                LayerTypeProfile(
                    name=m.name,
                    num_layers=m.num_layers,
                    hidden_size=m.hidden,
                    seq_length=seq,
                    forward_time=_forward_time(sweep, m.times, seq),
                    parameter_mib=m.parameter_bytes / MIB,
                    activation_mib_per_sample={d: b / MIB for d, b in acts.bytes_per_sample[act_mode].items()},
                    checkpoint_activation_mib_per_sample=acts.checkpoint_bytes_per_sample["tp"][1] / MIB,
                    megatron_sp_activation_mib_per_sample=_per_degree(acts, "megatron_sp"),
                    ulysses_activation_mib_per_sample=_per_degree(acts, "ulysses"),
                    activation_mib_per_call=max(0, acts.constant_bytes["tp"][1]) / MIB,  # the plain layer's
                    weight_grad_share=m.weight_grad_share.get(seq),
                    experts=m.experts.get(seq),
                    attention_core=m.attention_core,
                    parallel_overhead_ms={
                        mode: dict(by_degree) for mode, by_degree in acts.overhead_ms.items() if by_degree
                    },
                    sharded_overhead_ms={dp: dict(by_degree) for dp, by_degree in acts.sharded_overhead_ms.items()},
                    sharded_accumulate_ms={
                        dp: dict(by_degree) for dp, by_degree in acts.sharded_accumulate_ms.items()
                    },
                    split_backward_overhead_ms=m.split_overhead_ms.get(seq, 0.0),
                    backward_time=_forward_time(sweep, m.times, seq, backward=True),
                    optimizer_step_ms=_step_ms(m.step),
                )
            )
        vocab = sweep.vocab[seq]
        memory = {
            position: VocabMemory(
                model_states_mib=vocab.model_states_mib[position],
                activation_mib_per_sample=vocab.activation_mib_per_sample[position],
            )
            for position in POSITIONS
        }
        constraints = sweep.model.constraints(seq)
        profiles[seq] = ModelProfile(
            model_name=sweep.model.name,
            precision=options.precision,
            megatron_sp=options.megatron_sp,
            layer_types=tuple(layer_types),
            vocab=VocabProfile(
                vocab_size=None if _reads_images(sweep.model) else int(sweep.model.config.vocab_size),
                forward_time=_forward_time(sweep, {s: v.times for s, v in sweep.vocab.items()}, seq),
                memory_pp_off=memory["pp_off"],
                memory_pp_first=memory["pp_first"],
                memory_pp_last=memory["pp_last"],
                backward_time=_forward_time(sweep, {s: v.times for s, v in sweep.vocab.items()}, seq, backward=True),
                optimizer_step_ms=_step_ms(sweep.vocab_step),
                forms={name: dict(by_degree) for name, by_degree in vocab.forms.items()},
            ),
            constraints=constraints,
            # the call's own work: the layers' measurement (the first type's: one call, whatever the type)
            optimizer_call_ms=sweep.layers[0].step.per_call_ms if sweep.layers[0].step else None,
            compute_reference_ms=sweep.reference_ms,
        )
    return profiles


def _step_ms(step: StepCost | None) -> tuple[float, float] | None:
    """A module's share of the optimizer step as the profile keeps it: (ms per module, ms per million)."""
    return None if step is None else (step.per_module_ms, step.per_million_ms)
