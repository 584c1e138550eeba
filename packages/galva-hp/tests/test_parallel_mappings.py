"""Autograd collectives vs the same maths done on one process, on real gloo ranks.

Every rank can rebuild every member's input and upstream gradient from a seed, so it checks its own forward result
and input gradient against the single-process formula. Groups: the whole world of 2, and on 4 ranks the contiguous
pairs {0,1}/{2,3}, the strided pairs {0,2}/{1,3} (so {1,3} holds no rank 0) and the world of 4.
Tolerance: relative 1e-5 (fp32; data movement is exact, sums may be reordered).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from galva_comm.testing import run_distributed
from galva_hp.parallel import mappings as M
from galva_hp.testing.compare import assert_rel_close

TOL = 1e-5
SHAPE = (4, 8, 4, 8)  # [batch, seq, heads, head_dim]: every dim divides by 4


def _tensor(seed: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def _check_group(members: list[int], tag: str) -> None:
    """Run every mapping in the group formed by ``members`` (this rank is one of them)."""
    group = dist.new_group(members) if len(members) < dist.get_world_size() else dist.group.WORLD
    if dist.get_rank() not in members:
        return
    n, me = len(members), members.index(dist.get_rank())
    xs = [_tensor(1000 + 10 * r) for r in members]  # each member's own input
    shared = _tensor(3000)  # an input replicated over the group

    def grad_of(i: int, shape: torch.Size | list[int]) -> torch.Tensor:  # member i's upstream gradient
        return _tensor(2000 + 10 * members[i], tuple(shape))

    def run(fn, x):  # forward, then backward with this rank's upstream gradient
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(grad_of(me, y.shape))
        return y.detach(), x.grad

    where = f"{tag} rank {dist.get_rank()}"

    y, gx = run(lambda x: M.differentiable_copy_to_group(x, group), shared)
    assert_rel_close(y, shared, TOL, f"copy_to fwd {where}")
    assert_rel_close(gx, sum(grad_of(r, SHAPE) for r in range(n)), TOL, f"copy_to bwd {where}")

    y, gx = run(lambda x: M.differentiable_reduce_from_group(x, group), xs[me])
    assert_rel_close(y, sum(xs), TOL, f"reduce_from fwd {where}")
    assert_rel_close(gx, grad_of(me, SHAPE), TOL, f"reduce_from bwd {where}")

    for dim in (0, 1, -1):
        full_shape = list(SHAPE)
        full_shape[dim] *= n
        y, gx = run(lambda x, d=dim: M.differentiable_all_gather(x, d, group), xs[me])
        assert_rel_close(y, torch.cat(xs, dim), TOL, f"gather dim {dim} fwd {where}")
        summed = sum(grad_of(r, full_shape) for r in range(n))
        assert_rel_close(gx, summed.chunk(n, dim)[me], TOL, f"gather dim {dim} bwd {where}")

        small_shape = list(SHAPE)
        small_shape[dim] //= n
        y, gx = run(lambda x, d=dim: M.differentiable_reduce_scatter(x, d, group), xs[me])
        assert_rel_close(y, sum(xs).chunk(n, dim)[me], TOL, f"reduce_scatter dim {dim} fwd {where}")
        gathered = torch.cat([grad_of(r, small_shape) for r in range(n)], dim)
        assert_rel_close(gx, gathered, TOL, f"reduce_scatter dim {dim} bwd {where}")

        y, gx = run(lambda x, d=dim: M.differentiable_split(x, d, group), shared)
        assert_rel_close(y, shared.chunk(n, dim)[me], TOL, f"split dim {dim} fwd {where}")
        assert_rel_close(gx, gathered, TOL, f"split dim {dim} bwd {where}")

    for scatter_dim, gather_dim in ((2, 1), (1, 2), (0, 3), (3, 0)):
        y, gx = run(lambda x, s=scatter_dim, g=gather_dim: M.differentiable_all_to_all(x, s, g, group), xs[me])
        expected = torch.cat([xs[j].chunk(n, scatter_dim)[me] for j in range(n)], gather_dim)
        assert_rel_close(y, expected, TOL, f"differentiable_all_to_all {scatter_dim}->{gather_dim} fwd {where}")
        out_shape = expected.shape
        expected_grad = torch.cat([grad_of(r, out_shape).chunk(n, gather_dim)[me] for r in range(n)], scatter_dim)
        assert_rel_close(gx, expected_grad, TOL, f"differentiable_all_to_all {scatter_dim}->{gather_dim} bwd {where}")

    # several tensors in one exchange (Ulysses' q, k, v; other head counts and head sizes, the last output unused):
    # exactly what one all-to-all per tensor gives, forward and backward
    many = [xs[me], _tensor(5000 + members[me], (4, 8, 8, 8)), _tensor(6000 + members[me], (4, 8, 4, 6))]
    for scatter_dim, gather_dim in ((2, 1), (1, 2)):
        ins = [t.clone().requires_grad_() for t in many]
        outs = M.differentiable_all_to_all_many(ins, scatter_dim, gather_dim, group)
        sum((o * grad_of(me, o.shape)).sum() for o in outs[:2]).backward()
        for i, (t, out) in enumerate(zip(many, outs)):
            alone = t.clone().requires_grad_()
            expected = M.differentiable_all_to_all(alone, scatter_dim, gather_dim, group)
            (expected * (grad_of(me, expected.shape) if i < 2 else 0)).sum().backward()
            assert torch.equal(out, expected) and torch.equal(ins[i].grad, alone.grad), f"all_to_all_many {i} {where}"

    # uneven rows (token dispatch): member i sends (i + j) % 3 rows to member j, some of them none
    def rows(i: int) -> torch.Tensor:
        return _tensor(4000 + 10 * members[i], (sum((i + j) % 3 for j in range(n)), 5))

    send = [(me + j) % 3 for j in range(n)]
    receive = [(j + me) % 3 for j in range(n)]
    y, gx = run(lambda x: M.differentiable_all_to_all_uneven(x, send, receive, group), rows(me))

    def block(i: int, j: int, t: torch.Tensor, counts: list[int]) -> torch.Tensor:  # rows i sends j / gets from j
        start = sum(counts[:j])
        return t[start : start + counts[j]]

    expected = torch.cat([block(j, me, rows(j), [(j + k) % 3 for k in range(n)]) for j in range(n)])
    assert_rel_close(y, expected, TOL, f"all_to_all_uneven fwd {where}")
    grads = [grad_of(j, [sum((k + j) % 3 for k in range(n)), 5]) for j in range(n)]
    expected_grad = torch.cat([block(j, me, grads[j], [(k + j) % 3 for k in range(n)]) for j in range(n)])
    assert_rel_close(gx, expected_grad, TOL, f"all_to_all_uneven bwd {where}")


def _mappings_on_world(rank: int, world_size: int) -> bool:
    torch.manual_seed(0)
    if world_size == 2:
        _check_group([0, 1], "world2")
    else:
        # new_group is collective: every rank creates every group, in the same order
        for members, tag in (([0, 1], "pair01"), ([2, 3], "pair23"), ([0, 2], "strided02"), ([1, 3], "strided13")):
            _check_group(members, tag)
        _check_group([0, 1, 2, 3], "world4")
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_mappings_match_single_process_maths(world_size: int) -> None:
    assert run_distributed(_mappings_on_world, world_size, timeout=120) == [True] * world_size


def test_mappings_are_identity_without_a_group() -> None:
    x = torch.randn(2, 4, 3, requires_grad=True)
    for fn in (
        lambda t: M.differentiable_copy_to_group(t, None),
        lambda t: M.differentiable_reduce_from_group(t, None),
        lambda t: M.differentiable_all_gather(t, 1, None),
        lambda t: M.differentiable_reduce_scatter(t, 1, None),
        lambda t: M.differentiable_split(t, 1, None),
        lambda t: M.differentiable_all_to_all(t, 1, 2, None),
        lambda t: M.differentiable_all_to_all_uneven(t, [2], [2], None),
    ):
        assert fn(x) is x


def _indivisible(rank: int, world_size: int) -> str:
    try:
        M.differentiable_split(torch.zeros(2, 3), 1, dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_indivisible_split_names_the_dim() -> None:
    messages = run_distributed(_indivisible, 2, timeout=60)
    assert all("dim 1 has size 3, not divisible by the group size 2" in m for m in messages)
