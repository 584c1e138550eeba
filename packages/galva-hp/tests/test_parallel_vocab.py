"""Vocabulary parallelism equals the single-process embedding and head: outputs, loss, input and weight gradients.

Modes: vocab tp (2, 4; contiguous, strided {1,3}, world), vocab tp + Megatron-SP, vocab sp. Vocabulary 128 and 127
(127 is padded to 128: the padding must not change the loss or any gradient). Tiny GPT covers learned positions and
the tied head; tiny Llama the RMSNorm head. Labels include ignored (-100) tokens. Each rank's ``loss_sum`` and
``token_count`` are summed over the group (every token is owned by exactly one rank); vocab-sp weight gradients are
summed over the sp group as the runtime's sharding-group reduction does.
Tolerance: relative 1e-5 (fp32).
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
from galva_hp.parallel.vocab import IGNORE_INDEX, padded_vocab_size, vocab_range
from galva_hp.testing.compare import assert_rel_close, assert_states_close, named_grads
from galva_hp.testing.models import tiny_gpt, tiny_llama

TOL = 1e-5
BATCH, SEQ, HIDDEN = 2, 16, 32


def _context(mode: str, group) -> ParallelContext:
    if mode == "vocab_sp":
        return ParallelContext(sp_group=group, vocab_sp=True)
    return ParallelContext(tp_group=group, megatron_sp=mode == "tp_sp")


def _check_vocab(family: str, vocab: int, mode: str, members: list[int], tag: str) -> None:
    group = dist.new_group(members) if len(members) < dist.get_world_size() else dist.group.WORLD
    if dist.get_rank() not in members:
        return
    n, me = len(members), members.index(dist.get_rank())
    where = f"{family} V={vocab} {mode} {tag} rank {dist.get_rank()}"
    model = tiny_gpt(vocab_size=vocab, seed=4) if family == "gpt" else tiny_llama(vocab_size=vocab, seed=4)
    ctx = _context(mode, group)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    ids[0, :4] = vocab - 1  # the last (possibly padded-shard) id is always used
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels[:, -1] = IGNORE_INDEX
    labels[1, 3] = IGNORE_INDEX
    labels[0, 5] = vocab - 1
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    grad_out = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(n, dim=1)[me] if ctx.seq_sharded else t

    def summed_if_sp(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: all_reduce_sum(g, group) for k, g in grads.items()} if mode == "vocab_sp" else grads

    # embedding: input ids are the full sequence except under vocab sp
    ref_emb = copy.deepcopy(model.embedding)
    out_ref = ref_emb(ids)
    out_ref.backward(grad_out)
    emb = model.parallelizer.embedding(model.embedding, ctx)
    out = emb(ids if mode != "vocab_sp" else local(ids))
    out.backward(local(grad_out))
    assert_rel_close(out, local(out_ref.detach()), TOL, f"{where} embedding forward")
    assert_states_close(gather_full_state(emb), dict(ref_emb.named_parameters()), 0.0, f"{where} embedding weights")
    grads = summed_if_sp(gather_full_state(emb, grads=True))
    assert_states_close(grads, named_grads(ref_emb), TOL, f"{where} embedding grads")

    # head: hidden and labels in the layer boundary layout
    ref_head = copy.deepcopy(model.head)
    h_ref = hidden.clone().requires_grad_()
    loss_ref, count_ref = ref_head(h_ref, labels)
    loss_ref.backward()
    head = model.parallelizer.head(model.head, ctx)
    h = local(hidden).clone().requires_grad_()
    loss_sum, count = head(h, local(labels))
    loss_sum.backward()
    assert_rel_close(all_reduce_sum(loss_sum.detach(), group), loss_ref.detach(), TOL, f"{where} loss sum")
    assert int(all_reduce_sum(count, group)) == int(count_ref), f"{where} token count"
    assert_rel_close(h.grad, local(h_ref.grad), TOL, f"{where} head input grad")
    grads = summed_if_sp(gather_full_state(head, grads=True))
    assert_states_close(grads, named_grads(ref_head), TOL, f"{where} head grads")


def _vocab_on_world(rank: int, world_size: int, family: str) -> bool:
    for vocab in (128, 127):
        for mode in ("tp", "tp_sp", "vocab_sp"):
            if world_size == 2:
                _check_vocab(family, vocab, mode, [0, 1], "world2")
            else:
                for members, tag in (([0, 1], "pair01"), ([2, 3], "pair23"), ([1, 3], "strided13")):
                    _check_vocab(family, vocab, mode, members, tag)
                _check_vocab(family, vocab, mode, [0, 1, 2, 3], "world4")
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_vocab_parallel_equals_single_process(family: str, world_size: int) -> None:
    assert run_distributed(_vocab_on_world, world_size, family, timeout=180) == [True] * world_size


def test_vocab_padding_rule() -> None:
    assert padded_vocab_size(127, 4) == 128
    assert [vocab_range(127, 4, r) for r in range(4)] == [(0, 32, 32), (32, 64, 32), (64, 96, 32), (96, 127, 32)]
    # a shard made only of padding still has its rows, and owns no id
    assert vocab_range(5, 4, 3) == (6, 6, 2)
