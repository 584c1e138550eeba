"""A converted decoder layer equals the original: forward, input gradient and every weight gradient.

Modes: Megatron tp (2, 4), tp + Megatron-SP, Ulysses (2, 4). Families: tiny GPT (LayerNorm, GELU, biases) and tiny
Llama (RMSNorm, SwiGLU, RoPE, GQA with 4 heads / 2 KV heads: tp 2 splits the KV heads, tp 4 replicates them; Ulysses
2 exchanges 2 KV heads, Ulysses 4 repeats them). On 4 ranks every mode runs in the contiguous pairs, the strided
pairs ({1,3} holds no rank 0) and the world group. Shards are gathered with ``gather_full_state``; Ulysses weight
gradients (partial per sequence shard) are summed over the sp group as the runtime's sharding-group reduction does.
``causal=False`` (encoders) is checked on the bare attention blocks against an unmasked oracle: tp 2, tp 2 +
Megatron-SP and Ulysses 2, MHA and GQA. Tolerance: relative 1e-5 (fp32; only summation order differs), plus an
absolute 1e-6 (norm) on weight gradients for the key biases, whose exact gradient is zero (softmax ignores them) so
only rounding noise is compared.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from galva_comm.testing import run_distributed
from galva_hp.model import ParallelContext
from galva_hp.parallel.mappings import all_reduce_sum
from galva_hp.parallel.tensor_parallel import gather_full_state
from galva_hp.testing.compare import assert_rel_close, assert_states_close, named_grads, relative_error
from galva_hp.testing.models import tiny_gpt, tiny_llama

TOL = 1e-5
ZERO_GRAD_ATOL = 1e-6
BATCH, SEQ = 2, 16


def _model(family: str):
    return tiny_gpt(seed=3) if family == "gpt" else tiny_llama(seed=3)


def _check_layer(family: str, mode: str, members: list[int], tag: str) -> None:
    group = dist.new_group(members) if len(members) < dist.get_world_size() else dist.group.WORLD
    if dist.get_rank() not in members:
        return
    n, me = len(members), members.index(dist.get_rank())
    where = f"{family} {mode} {tag} rank {dist.get_rank()}"
    model = _model(family)
    source = model.layers[1]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, SEQ, 32, generator=gen)
    grad_out = torch.randn(BATCH, SEQ, 32, generator=gen)

    reference = copy.deepcopy(source)
    x_ref = x.clone().requires_grad_()
    out_ref = reference(x_ref)
    out_ref.backward(grad_out)

    if mode == "ulysses":
        ctx = ParallelContext(sp_group=group)
    else:
        ctx = ParallelContext(tp_group=group, megatron_sp=mode == "tp_sp")
    layer = model.parallelizer.layer(source, "decoder", ctx)
    source_params = {id(p) for p in source.parameters()}
    assert not any(id(p) in source_params for p in layer.parameters()), f"{where}: shares a parameter"

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(n, dim=1)[me] if ctx.seq_sharded else t

    x_local = local(x).clone().requires_grad_()
    out = layer(x_local)
    out.backward(local(grad_out))
    assert_rel_close(out, local(out_ref.detach()), TOL, f"{where} forward")
    assert_rel_close(x_local.grad, local(x_ref.grad), TOL, f"{where} input grad")

    assert_states_close(gather_full_state(layer), dict(reference.named_parameters()), 0.0, f"{where} weights")
    grads = gather_full_state(layer, grads=True)
    if mode == "ulysses":
        grads = {name: all_reduce_sum(g, group) for name, g in grads.items()}
    assert_states_close(grads, named_grads(reference), TOL, f"{where} weight grads", ZERO_GRAD_ATOL)


def _layers_on_world(rank: int, world_size: int, family: str) -> bool:
    torch.manual_seed(0)
    for mode in ("tp", "tp_sp", "ulysses"):
        if world_size == 2:
            _check_layer(family, mode, [0, 1], "world2")
        else:
            for members, tag in (([0, 1], "pair01"), ([2, 3], "pair23"), ([0, 2], "strided02"), ([1, 3], "strided13")):
                _check_layer(family, mode, members, tag)
            _check_layer(family, mode, [0, 1, 2, 3], "world4")
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_converted_layer_equals_original(family: str, world_size: int) -> None:
    assert run_distributed(_layers_on_world, world_size, family, timeout=180) == [True] * world_size


def _mqa_on_world(rank: int, world_size: int) -> bool:
    # one KV head: tp replicates it on every rank, Ulysses repeats it world_size times
    model = tiny_llama(kv_heads=1, seed=5)
    source = model.layers[0]
    gen = torch.Generator().manual_seed(9)
    x, grad_out = torch.randn(BATCH, SEQ, 32, generator=gen), torch.randn(BATCH, SEQ, 32, generator=gen)
    reference = copy.deepcopy(source)
    x_ref = x.clone().requires_grad_()
    reference(x_ref).backward(grad_out)
    for ctx in (ParallelContext(tp_group=dist.group.WORLD), ParallelContext(sp_group=dist.group.WORLD)):
        layer = model.parallelizer.layer(source, "decoder", ctx)
        sharded = ctx.seq_sharded
        x_local = (x.chunk(world_size, 1)[rank] if sharded else x).clone().requires_grad_()
        layer(x_local).backward(grad_out.chunk(world_size, 1)[rank] if sharded else grad_out)
        expected_x = x_ref.grad.chunk(world_size, 1)[rank] if sharded else x_ref.grad
        assert_rel_close(x_local.grad, expected_x, TOL, f"mqa {ctx} input grad")
        grads = gather_full_state(layer, grads=True)
        if sharded:
            grads = {name: all_reduce_sum(g, dist.group.WORLD) for name, g in grads.items()}
        assert_states_close(grads, named_grads(reference), TOL, f"mqa {ctx} weight grads", ZERO_GRAD_ATOL)
    return True


@pytest.mark.distributed
def test_single_kv_head_under_tp_and_ulysses() -> None:
    assert run_distributed(_mqa_on_world, 4, timeout=120) == [True] * 4


class _UnmaskedAttention(torch.nn.Module):
    """Single-process oracle for ``causal=False``: softmax attention with no mask, written out (no SDPA), GQA by
    repeating each K/V head for its query heads."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = torch.nn.Linear(hidden, hidden)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim)
        self.o_proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d, repeat = self.head_dim, self.heads // self.kv_heads
        q = self.q_proj(x).view(b, s, self.heads, d).transpose(1, 2)
        k, v = (p(x).view(b, s, self.kv_heads, d).transpose(1, 2).repeat_interleave(repeat, 1)
                for p in (self.k_proj, self.v_proj))  # fmt: skip
        weights = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1)  # every query sees every key
        return self.o_proj((weights @ v).transpose(1, 2).reshape(b, s, -1))


def _attention_block(mode: str, source: _UnmaskedAttention, causal: bool) -> torch.nn.Module:
    """galva-hp's tp (``tp`` / ``tp_sp``) or Ulysses attention over the world group, from copies of ``source``."""
    from galva_hp.parallel.tensor_parallel import TensorParallelAttention
    from galva_hp.parallel.ulysses import UlyssesAttention

    projections = (source.q_proj, source.k_proj, source.v_proj, source.o_proj)
    heads = {"heads": source.heads, "kv_heads": source.kv_heads, "group": dist.group.WORLD, "causal": causal}
    if mode == "ulysses":
        return UlyssesAttention(*(copy.deepcopy(p) for p in projections), head_dim=source.head_dim, **heads)
    return TensorParallelAttention(
        *(p.weight for p in projections), *(p.bias for p in projections), sequence_parallel=mode == "tp_sp", **heads
    )


def _bidirectional_on_world(rank: int, world_size: int) -> bool:
    """``causal=False`` tp (plain and Megatron-SP) and Ulysses attention equal the unmasked oracle (MHA and GQA);
    the same blocks with the default ``causal=True`` do not (the test can tell the two apart)."""
    for kv_heads in (4, 2):
        source = _UnmaskedAttention(32, 4, kv_heads, seed=11)
        gen = torch.Generator().manual_seed(13)
        x, grad_out = torch.randn(BATCH, SEQ, 32, generator=gen), torch.randn(BATCH, SEQ, 32, generator=gen)
        reference = copy.deepcopy(source)
        x_ref = x.clone().requires_grad_()
        out_ref = reference(x_ref)
        out_ref.backward(grad_out)
        for mode in ("tp", "tp_sp", "ulysses"):
            where = f"causal=False {mode} kv_heads={kv_heads} rank {rank}"
            parts = world_size if mode != "tp" else 1  # tp_sp and Ulysses hold a sequence slice
            x_local = x.chunk(parts, dim=1)[rank % parts].clone().requires_grad_()
            expected = out_ref.detach().chunk(parts, dim=1)[rank % parts]
            layer = _attention_block(mode, source, causal=False)
            out = layer(x_local)
            out.backward(grad_out.chunk(parts, dim=1)[rank % parts])
            assert_rel_close(out, expected, TOL, f"{where} forward")
            assert_rel_close(x_local.grad, x_ref.grad.chunk(parts, dim=1)[rank % parts], TOL, f"{where} input grad")
            grads = gather_full_state(layer, grads=True)
            if mode == "ulysses":
                grads = {name: all_reduce_sum(g, dist.group.WORLD) for name, g in grads.items()}
            assert_states_close(grads, named_grads(reference), TOL, f"{where} weight grads", ZERO_GRAD_ATOL)
            masked = _attention_block(mode, source, causal=True)(x_local.detach())
            assert relative_error(masked, expected) > 0.05, f"{where}: causal=True matches the unmasked oracle too"
    return True


@pytest.mark.distributed
def test_bidirectional_attention_equals_unmasked_attention() -> None:
    assert run_distributed(_bidirectional_on_world, 2, timeout=120) == [True, True]


def test_incompatible_heads_are_rejected() -> None:
    from galva_hp.parallel.ulysses import ulysses_kv_repeat

    assert ulysses_kv_repeat(4, 2, 2) == 1
    assert ulysses_kv_repeat(4, 2, 4) == 2
    assert ulysses_kv_repeat(8, 2, 4) == 2
    assert ulysses_kv_repeat(12, 3, 2) == 2
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        ulysses_kv_repeat(4, 2, 8)


class _ScaleNorm(torch.nn.Module):
    """A norm class galva-hp does not know (like Hugging Face's RMSNorm): takes the generic wrapper path."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * x / x.norm(dim=-1, keepdim=True)


def _sequence_parallel_norms(rank: int, world_size: int) -> list[list[str]]:
    from galva_hp.parallel.tensor_parallel import sequence_parallel_norm

    gen = torch.Generator().manual_seed(13)
    x, grad_out = torch.randn(2, 8, 6, generator=gen), torch.randn(2, 8, 6, generator=gen)
    layer_norm = torch.nn.LayerNorm(6)
    rms_norm = torch.nn.RMSNorm(6, eps=1e-6)
    with torch.no_grad():
        for p in [*layer_norm.parameters(), *rms_norm.parameters()]:
            p.copy_(torch.randn(p.shape, generator=gen))
    names = []
    for norm in (layer_norm, rms_norm, _ScaleNorm(6)):
        reference = copy.deepcopy(norm)
        reference(x).backward(grad_out)
        sp_norm = sequence_parallel_norm(norm, dist.group.WORLD)
        x_local = x.chunk(world_size, 1)[rank].clone().requires_grad_()
        out = sp_norm(x_local)
        out.backward(grad_out.chunk(world_size, 1)[rank])
        what = f"{type(norm).__name__} rank {rank}"
        assert_rel_close(out, reference(x).detach().chunk(world_size, 1)[rank], TOL, f"{what} forward")
        assert_states_close(gather_full_state(sp_norm, grads=True), named_grads(reference), TOL, f"{what} grads")
        assert all(getattr(p, "galva_sequence_parallel", False) for p in sp_norm.parameters())
        names.append([n for n, _ in sp_norm.named_parameters()])
    return names


@pytest.mark.distributed
def test_sequence_parallel_norms_sum_their_gradients_over_the_group() -> None:
    names = run_distributed(_sequence_parallel_norms, 2, timeout=60)[0]
    # LayerNorm / RMSNorm keep their parameter names; other classes are wrapped
    assert names == [["weight", "bias"], ["weight"], ["module.gain"]]


def _bf16_layer(rank: int, world_size: int, mode: str) -> float:
    model = tiny_llama(seed=3)
    source = model.layers[0]
    gen = torch.Generator().manual_seed(7)
    x, grad_out = torch.randn(BATCH, SEQ, 32, generator=gen), torch.randn(BATCH, SEQ, 32, generator=gen)
    x_ref = x.clone().requires_grad_()
    out_ref = copy.deepcopy(source)(x_ref)
    out_ref.backward(grad_out)
    if mode == "ulysses":
        ctx = ParallelContext(sp_group=dist.group.WORLD)
    else:
        ctx = ParallelContext(tp_group=dist.group.WORLD, megatron_sp=True)
    layer = model.parallelizer.layer(copy.deepcopy(source).to(torch.bfloat16), "decoder", ctx)
    assert all(p.dtype == torch.bfloat16 for p in layer.parameters())
    x_local = x.chunk(world_size, 1)[rank].to(torch.bfloat16).requires_grad_()
    out = layer(x_local)
    out.backward(grad_out.chunk(world_size, 1)[rank].to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert_rel_close(out.float(), out_ref.detach().chunk(world_size, 1)[rank], BF16_TOL, f"bf16 {mode} forward")
    assert_rel_close(x_local.grad.float(), x_ref.grad.chunk(world_size, 1)[rank], BF16_TOL, f"bf16 {mode} dgrad")
    return float(out.float().sum())


BF16_TOL = 2e-2  # bf16 keeps 8 mantissa bits (~4e-3 per rounding); a layer is a few dozen roundings deep


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["tp_sp", "ulysses"])
def test_bf16_layer_tracks_the_fp32_reference(mode: str) -> None:
    run_distributed(_bf16_layer, 2, mode, timeout=60)
