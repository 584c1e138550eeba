"""Model profiling on real galva-models layers: only a few modules are built, activations are exact saved bytes."""

from __future__ import annotations

import pytest

from galva_profiler.model_profile import ModelSweepOptions, model_profiles, run_model_sweep
from galva_profiler.model_report import sweep_report
from galva_profiler.model_source import MetaModel, load_config
from galva_profiler.timing import Repeats

SEQ, HIDDEN = 16, 64


@pytest.fixture(scope="module")
def sweep32():  # type: ignore[no-untyped-def]
    config, _ = load_config("tiny-llama", None)
    config.num_hidden_layers = 32
    model = MetaModel.build(config, "tiny-llama-32")
    options = ModelSweepOptions(
        seq_lengths=(SEQ,), batch_sizes=(1, 2), max_tp=2, repeats=Repeats(warmup=0, repetitions=1),
        timing_span_s=0.0,
    )
    return run_model_sweep(model, options, progress_enabled=False)


@pytest.mark.distributed
def test_a_32_layer_profile_builds_one_layer_and_the_vocabulary_modules(sweep32) -> None:  # type: ignore[no-untyped-def]
    from galva_hp.deferred_init import is_meta

    assert sweep32.model.built == ["layers.0", "embedding", "head"]
    layers = sweep32.model.layered.layers
    assert not is_meta(layers[0]) and all(is_meta(layer) for layer in layers[1:])


@pytest.mark.distributed
def test_profile_validates_with_constraints_and_measured_activations(sweep32) -> None:  # type: ignore[no-untyped-def]
    profile = model_profiles(sweep32)[SEQ]
    layer = profile.layer_types[0]
    assert layer.num_layers == 32 and profile.constraints is not None
    assert profile.constraints.layer_types[0].num_kv_heads == 2
    assert set(layer.activation_mib_per_sample) == {1, 2}
    assert layer.activation_mib_per_sample[2] < layer.activation_mib_per_sample[1]
    # checkpointed, a layer keeps only its fp32 input: exactly seq * hidden * 4 bytes per sample
    assert layer.checkpoint_activation_mib_per_sample * 2**20 == SEQ * HIDDEN * 4
    assert layer.parameter_mib * 2**20 == sum(p.numel() for p in sweep32.model.layered.layers[0].parameters()) * 4
    states = profile.vocab.memory_pp_off.model_states_mib
    norm_mib = HIDDEN * 16 / 2**20  # the final norm stays whole on every rank; embedding and head are halved
    assert states[2] == pytest.approx((states[1] - norm_mib) / 2 + norm_mib)
    acts = sweep32.layers[0].activations[SEQ]
    assert set(acts.bytes_per_sample) == {"tp", "megatron_sp", "ulysses"}
    assert acts.bytes_per_sample["ulysses"][2] > 0 and acts.bytes_per_sample["megatron_sp"][2] > 0
    # the attention core apart: tiny Llama's 2 key/value heads of 16 fp32 numbers, each for key and value
    core = layer.attention_core
    assert core is not None and core.causal and core.kv_bytes_per_token == 2 * 2 * 16 * 4
    assert core.seq_lengths == (SEQ // 4, SEQ // 2, SEQ)
    report = sweep_report(sweep32)
    fit = report["layers"][0]["by_seq_length"][SEQ]["forward_batch_fit"]
    assert len(fit["residuals"]) == 2
    # zb-h1's deferred work measured, not assumed: the weight-gradient share of the backward, in [0, 1) (a timing:
    # on a loaded machine the input-gradient pass can take as long as the whole backward, and the share clamps to 0)
    assert layer.weight_grad_share is not None and 0.0 <= layer.weight_grad_share < 1.0
    # what splitting that backward costs (galva-hp's own I then W against one autograd call): its graph analysis and
    # one autograd call per parameter group take time
    assert layer.split_backward_overhead_ms > 0.0
    # each parallel form's own cost per call beyond the plain layer, timed on the ranks that measured its bytes: the
    # tp form runs a plain layer's work plus its splits and collectives' bookkeeping, never less in both passes
    assert set(layer.parallel_overhead_ms) == {"tp", "megatron_sp", "ulysses"}
    assert all(set(by_degree) == {2} for by_degree in layer.parallel_overhead_ms.values())
    assert sum(layer.parallel_overhead_ms["tp"][2]) > 0.0
    # ZeRO's own cost on the same ranks: FSDP2's copies and hooks per call, AdamW through DTensor per step (each
    # op dispatched per shard: several times the plain shards' step, never less)
    assert {dp: set(by_degree) for dp, by_degree in layer.sharded_overhead_ms.items()} == {"zero2": {2}, "zero3": {2}}
    # the step: galva-hp steps the shards' local pieces, a few tenths of a ms beyond plain tensors (0 within noise)
    assert all(sum(f_b_step[2][:2]) > 0.0 and f_b_step[2][2] >= 0.0 for f_b_step in layer.sharded_overhead_ms.values())
    # and the backward of a micro-batch before the last (gradient sync off), timed on the same ranks for each
    assert {dp: set(by_degree) for dp, by_degree in layer.sharded_accumulate_ms.items()} == {"zero2": {2}, "zero3": {2}}
    # the backward measured beside the forward (the search's coefficient only stands in without it), and galva-hp's
    # optimizer step timed on the layer's own tensors: another layer's tensors always add work to the step
    assert layer.backward_time is not None and layer.backward_time.forward_ms(2, SEQ) > 0.0
    assert profile.vocab.backward_time is not None
    step = layer.optimizer_step_ms
    assert step is not None and step[0] + step[1] * layer.parameter_mib * 2**20 / 4 / 1e6 > 0.0
    assert profile.vocab.optimizer_step_ms is not None and profile.optimizer_call_ms is not None
    assert report["layers"][0]["optimizer_step"]["per_module_ms"] == layer.optimizer_step_ms[0]
    # the vocabulary's forms, on the ranks that measured their bytes: the calls each makes as recorded (vocab tp:
    # the embedding's forward all-reduce of the hidden state; the head's loss reduces over the vocabulary slices and
    # its backward all-reduces the hidden state's gradient; ZeRO-3: a unit per module gathering its parameters
    # forward and backward and reduce-scattering their gradients) and the work beyond the plain modules
    forms = profile.vocab.forms
    assert {name: set(by_degree) for name, by_degree in forms.items()} == {"tp": {2}, "zero3": {2}}
    hidden_state = SEQ * HIDDEN * 4
    embedding = forms["tp"][2].embedding.calls
    assert [(c.op, c.backward, c.bytes_per_sample, c.bytes_fixed) for c in embedding] == [
        ("all_reduce", False, hidden_state, 0.0)
    ]
    head = forms["tp"][2].head.calls
    assert ("all_reduce", True, hidden_state) in [(c.op, c.backward, c.bytes_per_sample) for c in head]
    assert sum(not c.backward for c in head) >= 2  # the vocabulary-parallel loss's own
    table = sum(p.numel() for p in sweep32.model.layered.embedding.parameters()) * 4
    zero3 = forms["zero3"][2].embedding.calls
    assert [(c.op, c.backward, c.bytes_fixed) for c in zero3] == [
        ("all_gather", False, table), ("all_gather", True, table), ("reduce_scatter", True, table)
    ]
    assert all(sum(f[2].part(p).overhead_ms[:2]) > 0.0 for f in forms.values() for p in ("embedding", "head"))
    # the reference matmul, sampled between the layers' timed rounds: the minutes the layers were timed in
    assert profile.compute_reference_ms is not None and profile.compute_reference_ms > 0.0


def test_an_image_model_s_vocabulary_takes_images_and_the_last_layer_s_shape() -> None:
    """ViT and Swin have no token vocabulary: the embedding reads images and the head a label per sample; Swin's
    head reads the last stage's grid (4 tokens of 128 here), not the embedding's (256 of 16)."""
    import torch

    from galva_profiler.model_profile import _vocab_inputs
    from galva_profiler.vocab import measure_vocab, tie

    config, _ = load_config("tiny-swin", None)
    model = MetaModel.build(config, "tiny-swin")
    model.embedding(torch.float32).train()
    model.head(torch.float32).train()
    tie(model.layered)
    inputs = _vocab_inputs(model, 256, torch.float32)
    assert inputs.image == (3, 32) and inputs.head_input == (4, 128) and inputs.token_vocab is None
    measured = measure_vocab(model.layered, inputs, 16, torch.float32, [1, 2], [1], False, Repeats(0, 1))
    head_params = sum(p.numel() for p in model.layered.head.parameters())
    assert measured.model_states_mib["pp_last"][1] == pytest.approx(head_params * 16 / 2**20)
    assert measured.activation_mib_per_sample["pp_first"][1] > 0 and measured.times[2].forward_ms > 0


@pytest.mark.parametrize(("family", "window"), [("mistral", 8), ("gemma2", 8), ("qwen2", None)])
def test_the_profile_records_which_layers_attend_within_a_sliding_window(family, window) -> None:  # type: ignore[no-untyped-def]
    """Read from the family's own per-layer attribute (Gemma 2 alternates windowed and whole-sequence layers) or its
    config's window (Mistral's every layer); none for a family without one (Qwen 2 keeps its window off by default)."""
    from galva_models.presets import tiny_config
    from galva_profiler.model_profile import _windows

    config = tiny_config(family, sliding_window=window)
    model = MetaModel.build(config, f"tiny-{family}")
    n = config.num_hidden_layers
    expected = {"qwen2": (None, 0), "mistral": (8, n)}.get(family)
    if family == "gemma2":
        expected = (8, config.layer_types.count("sliding_attention"))
        assert 0 < expected[1] < n
    assert _windows(model, 0) == expected


def test_an_encoder_decoder_is_cut_again_for_each_length_holding_what_was_made_real() -> None:
    """T5's layers pass [encoder ; decoder], so its cut depends on the length: each profiled length cuts the same
    modules again. What was made real stays real and is read: each stack's relative-position table (a shared weight
    at home in the stack's first layer), the token table tied across encoder, decoder and head (making modules real
    gave each holder its own tensor, and the cut refused a model whose encoder table no module held)."""
    import torch

    from galva_profiler.vocab import tie

    config, _ = load_config("tiny-t5", None)
    model = MetaModel.build(config, "tiny-t5", seq_length=8, decoder_seq_length=6)
    layer = model.layer(2, torch.float32)  # the decoder stack's first layer: its table's home
    home = "layer.layer.0.SelfAttention.relative_attention_bias.weight"
    assert model.layered.shared[1].param is layer.get_parameter(home)
    model.embedding(torch.float32)
    model.head(torch.float32)
    tie(model.layered)
    model.at_length(16)
    assert [layer.encoder_length for layer in model.layered.layers] == [16] * 4
    assert model.decoder_length(16) == 6 and model.constraints(16).layer_types[0].seq_length == 22
    table = model.layered.shared[1].param
    assert not table.is_meta and model.layered.layers[3].bias.table.param is table
    assert model.built == ["layers.2", "embedding", "head"]  # nothing more made real (the decoder's table: its home)
    out = model.layered.layers[2](torch.randn(1, 22, HIDDEN))
    assert out.shape == (1, 22, HIDDEN) and bool(out.isfinite().all())


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_profile_times_on_the_device_and_measures_the_same_bytes() -> None:
    """On a GPU the layers are timed where the job trains (a CPU-timed profile priced the quickstart's one-GPU step
    at 2.5x its measured time); activation bytes and model states are the CPU profile's, bit for bit."""
    import torch

    def sweep(device: str):  # type: ignore[no-untyped-def]
        config, _ = load_config("tiny-llama", None)
        options = ModelSweepOptions(
            seq_lengths=(SEQ,), batch_sizes=(1, 2), max_tp=1, repeats=Repeats(warmup=1, repetitions=3),
            timing_span_s=0.0, device=device, precision=__import__("galva_schema").Precision.BF16,
        )  # fmt: skip
        return run_model_sweep(MetaModel.build(config, "tiny-llama"), options, progress_enabled=False)

    on_cpu, on_gpu = sweep("cpu"), sweep("cuda")
    cpu_profile, gpu_profile = model_profiles(on_cpu)[SEQ], model_profiles(on_gpu)[SEQ]
    assert sweep_report(on_gpu)["device"] == "cuda" and sweep_report(on_cpu)["device"] == "cpu"
    for a, b in zip(cpu_profile.layer_types, gpu_profile.layer_types):
        assert a.activation_mib_per_sample == b.activation_mib_per_sample and a.parameter_mib == b.parameter_mib
    assert cpu_profile.vocab.memory_pp_off == gpu_profile.vocab.memory_pp_off
    gpu_layer = gpu_profile.layer_types[0]
    assert gpu_layer.forward_time.intercept_ms > 0 and gpu_layer.attention_core is not None
    # the modules went back to CPU after their timing: the forked activation ranks read them there
    assert all(p.device.type == "cpu" for p in on_gpu.model.layered.embedding.parameters())
    assert torch.cuda.memory_allocated() < 2**20 * 256  # nothing left there but the cuBLAS workspaces (65 MiB, H100)


@pytest.mark.distributed
def test_bytes_measured_in_a_cpu_process_are_the_same(sweep32) -> None:  # type: ignore[no-untyped-def]
    """Where a GPU is visible the bytes are measured in a spawned process that sees none (a rank forked after
    autograd ran on a GPU machine cannot run a backward); its figures are the in-process ones, tp 2 forks included."""
    import torch

    from galva_profiler import model_profile

    model = sweep32.model
    layers = model_profile._layer_measurements(model, torch.float32, SEQ)
    vocab = model_profile._measure_bytes_in_a_cpu_process(model, layers, sweep32.options)
    for here, there in zip(sweep32.layers, layers, strict=True):
        assert there.activations[SEQ].bytes_per_sample == here.activations[SEQ].bytes_per_sample
        assert there.activations[SEQ].bytes_per_sample["tp"].keys() == {1, 2}
        assert there.activations[SEQ].checkpoint_bytes_per_sample == here.activations[SEQ].checkpoint_bytes_per_sample
    assert vocab[SEQ].model_states_mib == sweep32.vocab[SEQ].model_states_mib
    assert vocab[SEQ].activation_mib_per_sample == sweep32.vocab[SEQ].activation_mib_per_sample


def test_a_failure_in_the_cpu_process_is_one_line(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from galva_profiler import model_profile
    from galva_profiler.errors import ProfileError

    config, _ = load_config("tiny-llama", None)
    model = MetaModel.build(config, "tiny-llama")
    layers = model_profile._layer_measurements(model, __import__("torch").float32, SEQ)
    options = ModelSweepOptions(seq_lengths=(SEQ,), batch_sizes=(1, 2), max_tp=1)
    model.seed = "not a seed"  # type: ignore[assignment]
    with pytest.raises(ProfileError, match=r"^measuring activation bytes in a CPU process: ") as raised:
        model_profile._measure_bytes_in_a_cpu_process(model, layers, options)
    assert "\n" not in str(raised.value)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="GPU"))],
)
def test_experts_are_timed_again_on_the_sweep_s_device(device) -> None:  # type: ignore[no-untyped-def]
    """A mixture of experts' bytes and routing are measured on CPU with the layer's; on a GPU its expert and router
    times are taken again there, everything else kept."""
    from galva_profiler import model_profile

    config, _ = load_config("tiny-mixtral", None)
    options = ModelSweepOptions(
        seq_lengths=(SEQ,), batch_sizes=(1, 2), max_tp=1, repeats=Repeats(warmup=0, repetitions=2),
        timing_span_s=0.0, device=device,
    )  # fmt: skip
    sweep = run_model_sweep(MetaModel.build(config, "tiny-mixtral"), options, progress_enabled=False)
    layer = sweep.layers[0]
    before = layer.experts[SEQ]
    model_profile._time_experts(sweep.model, layer, SEQ, options)
    after = layer.experts[SEQ]
    assert after.expert_time.slope_ms_per_sample >= 0.0 and after.router_ms_per_token > 0.0
    unchanged = {"expert_time", "router_ms_per_token"}
    assert after.model_dump(exclude=unchanged) == before.model_dump(exclude=unchanged)
    module = sweep.model.layer(layer.first_index, __import__("torch").float32)
    assert all(p.device.type == "cpu" for p in module.parameters())
