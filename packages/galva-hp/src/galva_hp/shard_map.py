"""Where each element of this rank's master parameters lives in the single-process model: the shard map.

A parallel form is made *from the single-process weights* (it copies its shard: rows of q/k/v fused into one
``qkv``, columns of ``o_proj``, padded vocabulary rows, transposed Conv1D weights ...), and FSDP2 then keeps 1/dp
of dim 0 of it. Rather than teach every form to describe its layout, :func:`shard_map` finds the layout by
construction: it fills a fresh single-process module with *labels* (each element's index, exact in fp32),
converts it with the same parallel form and context as the live model, and reads back where every local element
came from. The result is compressed into boxes: runs of local dim-0 rows that are one rectangular block of one
single-process tensor, possibly with its axes permuted (``perm[k]`` is the source axis of local axis k).

A copy of a parameter shared between layers (:mod:`galva_hp.shared_params`) is always the whole tensor: one box.

Saving writes each box into its place in the full tensor; loading reads each box with a slice read and copies it
in. No collective is needed: every rank converts only its own modules, under a forked RNG (the conversion must
not move the training RNG).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from galva_hp.activation_checkpoint import unwrapped_name
from galva_hp.data_parallel import local_tensor
from galva_hp.model import LayeredModel
from galva_hp.runtime import HybridParallelModel
from galva_schema.vocabulary import EMBEDDING_MODULE, HEAD_MODULE, layer_of_module

__all__ = ["ShardBox", "local_rows", "shard_map"]

_LO_BITS = 22  # labels below 2**24 are exact in fp32; two passes (low and high bits) cover any module size
_FIRST = 2  # labels start at 2: padding rows are zero and fresh norms one, so 0 and 1 mean "no source"


@dataclass(frozen=True)
class ShardBox:
    """Rows ``rows`` of a master parameter's *full local* tensor (before FSDP sharding) are the block
    ``offsets`` / ``sizes`` of the single-process tensor ``source`` (Galva name), axes permuted by ``perm``."""

    rows: tuple[int, int]
    source: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    perm: tuple[int, ...]
    cols: tuple[int, int] | None = None
    """Local columns (axis 1) ``[start, stop)`` of those rows, where a row holds pieces of several blocks (a packed
    projection split along its columns: GPT-2's Conv1D ``c_attn``; an expert's gate and up parts under etp); None:
    the whole rows."""

    def restrict(self, start: int, stop: int) -> ShardBox | None:
        """This box cut to local rows ``[start, stop)`` (an FSDP shard), or None when they do not meet."""
        lo, hi = max(self.rows[0], start), min(self.rows[1], stop)
        if lo >= hi:
            return None
        axis = self.perm[0]
        offsets, sizes = list(self.offsets), list(self.sizes)
        offsets[axis] += lo - self.rows[0]
        sizes[axis] = hi - lo
        return ShardBox((lo, hi), self.source, tuple(offsets), tuple(sizes), self.perm, self.cols)

    def cut(self, rows: Tensor) -> Tensor:
        """This box's part of the local rows ``rows`` (already cut to :attr:`rows`)."""
        return rows if self.cols is None else rows[:, self.cols[0] : self.cols[1]]

    def to_source(self, local: Tensor) -> Tensor:
        """The local rows of this box (already cut out) in the source tensor's layout."""
        inverse = [self.perm.index(axis) for axis in range(len(self.perm))]
        return local.permute(inverse)

    def to_local(self, source: Tensor) -> Tensor:
        """A block read from the source tensor, in the local tensor's layout."""
        return source.permute(self.perm)


def local_rows(param: Tensor) -> tuple[int, int]:
    """Rows ``[start, stop)`` of the full local tensor that this rank's piece of ``param`` holds (FSDP2 shards dim 0;
    a plain tensor holds all of them)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 1
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(not isinstance(p, Shard) or p.dim != 0 for p in param.placements if not p.is_replicate()):
        raise ValueError(f"unsupported placement {param.placements}: only dim-0 sharding (FSDP2)")
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    start = offset[0] if shape[0] else 0
    return start, start + shape[0]


def shard_map(model: HybridParallelModel, fresh: LayeredModel) -> dict[str, list[ShardBox]]:
    """Master parameter name (as :meth:`~HybridParallelModel.param_records` names it) -> its boxes.

    ``fresh`` is the same model decomposed again (on the meta device: no memory until each module is labelled);
    its modules are consumed. Every local element either has a box or is padding (zero in the live model).
    """
    modules: dict[str, nn.Module] = dict(fresh.galva_modules())
    parallelizer = fresh.parallelizer
    records = {r.name: r.param for r in model.param_records()}
    out: dict[str, list[ShardBox]] = {}
    units: dict[str, list[str]] = {}  # module -> its units (a layer's experts are a unit of their own inside it)
    for unit in model.units:
        units.setdefault(_module_of(unit.name), []).append(unit.name)
    for name, unit_names in units.items():
        ctx = model.contexts[name]
        single = modules[name]
        single.to_empty(device="cpu")
        sources = [(f"{name}.{n}", p) for n, p in single.named_parameters(remove_duplicate=False)]
        total = sum(p.numel() for _, p in sources) + _FIRST
        passes = [0] if total < (1 << 24) else [0, _LO_BITS]
        labelled: list[dict[str, Tensor]] = []
        for shift in passes:
            _label(sources, shift, single_pass=len(passes) == 1)
            labelled_module = copy.deepcopy(single)  # a parallelizer may convert in place, once per module
            with torch.random.fork_rng(devices=[]):
                index = layer_of_module(name)
                if name == EMBEDDING_MODULE:
                    converted = parallelizer.embedding(labelled_module, ctx)
                elif name == HEAD_MODULE:
                    converted = parallelizer.head(labelled_module, ctx)
                else:
                    assert index is not None
                    converted = parallelizer.layer(labelled_module, layer_type=fresh.layer_types[index], ctx=ctx)
            labelled.append({n: p.detach().clone() for n, p in converted.named_parameters()})
        single.to_empty(device="meta")
        offsets = torch.tensor([0] + [p.numel() for _, p in sources]).cumsum(0)
        for unit_name in unit_names:
            path = unit_name[len(name) + 1 :]  # the unit's place inside the module ("" for the module's own unit)
            for local_name, _ in _unit_parameters(model, unit_name):
                record = f"{unit_name}.{local_name}"
                if record not in records:
                    continue
                key = f"{path}.{local_name}" if path else local_name
                key = unwrapped_name(key)
                parts = [lab[key] for lab in labelled]
                out[record] = _boxes(record, parts, sources, offsets)
    for shared in model.shared.records():  # a shared parameter's copy is the whole single-process tensor
        shape = tuple(shared.param.shape)
        dims = tuple(range(len(shape)))
        out[shared.name] = [ShardBox((0, shape[0] if shape else 1), shared.name, (0,) * len(shape), shape, dims)]
    return out


def _module_of(unit_name: str) -> str:
    """The Galva module a data-parallel unit belongs to (``layers.3`` for ``layers.3.layer.mlp.experts``)."""
    head, _, rest = unit_name.partition(".")
    return f"{head}.{rest.partition('.')[0]}" if head == "layers" else head


def _unit_parameters(model: HybridParallelModel, unit_name: str) -> list[tuple[str, nn.Parameter]]:
    unit = next(u for u in model.units if u.name == unit_name)
    return unit.master_parameters()


def _label(sources: list[tuple[str, nn.Parameter]], shift: int, single_pass: bool) -> None:
    start = _FIRST
    with torch.no_grad():
        for _, param in sources:
            index = torch.arange(start, start + param.numel(), dtype=torch.float64)
            if not single_pass:
                index = torch.floor(index / (1 << shift)) if shift else torch.remainder(index, 1 << _LO_BITS)
            param.copy_(index.reshape(param.shape).to(param.dtype))
            start += param.numel()


def _global_index(parts: list[Tensor]) -> Tensor:
    """Label of every local element (int64; -1 where it is not an exact label)."""
    if len(parts) == 1:
        value = local_tensor(parts[0]).double()
        index = value.round().long()
        return torch.where(value == index.double(), index, -1)
    lo, hi = (local_tensor(p).double() for p in parts)
    ok = (lo == lo.round()) & (hi == hi.round()) & (lo >= 0) & (lo < (1 << _LO_BITS))
    index = hi.round().long() * (1 << _LO_BITS) + lo.round().long()
    return torch.where(ok, index, -1)


def _boxes(
    record: str, parts: list[Tensor], sources: list[tuple[str, nn.Parameter]], offsets: Tensor
) -> list[ShardBox]:
    labels = _global_index(parts)
    if labels.dim() == 0:
        labels = labels.reshape(1)
    try:
        return _row_boxes(record, labels, sources, offsets, None)
    except ValueError:
        if labels.dim() < 2:
            raise
    # rows holding pieces of several blocks (GPT-2's packed c_attn; an expert's gate and up parts under etp): cut
    # axis 1 where the first row's labels stop running on with the step they run on
    flat = labels[0].reshape(labels.shape[1], -1)[:, 0]
    steps = (flat[1:] - flat[:-1]).tolist()
    step = max(set(steps), key=steps.count) if steps else 1
    breaks = [0] + [c for c in range(1, flat.shape[0]) if steps[c - 1] != step] + [flat.shape[0]]
    boxes: list[ShardBox] = []
    for c0, c1 in itertools.pairwise(breaks):
        boxes += _row_boxes(record, labels[:, c0:c1], sources, offsets, (c0, c1))
    return boxes


def _row_boxes(
    record: str, labels: Tensor, sources: list[tuple[str, nn.Parameter]], offsets: Tensor, cols: tuple[int, int] | None
) -> list[ShardBox]:
    flat = labels - _FIRST
    valid = (flat >= 0) & (flat < int(offsets[-1]))
    which = torch.where(valid, torch.searchsorted(offsets, flat, right=True) - 1, -1)
    boxes: list[ShardBox] = []
    row, rows = 0, labels.shape[0]
    while row < rows:
        if not bool(valid[row].any()):
            row += 1  # padding row (vocabulary padded to a multiple of tp)
            continue
        if not bool(valid[row].all()) or bool((which[row] != which[row].reshape(-1)[0]).any()):
            raise ValueError(f"{record}: local row {row} mixes several single-process tensors or padding")
        src = int(which[row].reshape(-1)[0])
        name, param = sources[src]
        shape = tuple(param.shape) or (1,)
        local = flat[row:] - int(offsets[src])
        box = _box_at(local, which[row:], src, shape)
        if box is None:
            raise ValueError(f"{record}: local row {row} is no rectangular block of {name}")
        count, origin, perm = box
        sizes = tuple(count if axis == perm[0] else labels.shape[perm.index(axis)] for axis in range(len(shape)))
        if param.dim() == 0:  # a scalar parameter is stored as a one-element row here
            origin, sizes, perm = (), (), ()
        boxes.append(ShardBox((row, row + count), name, origin, sizes, perm, cols))
        row += count
    return boxes


def _box_at(
    local: Tensor, which: Tensor, src: int, shape: tuple[int, ...]
) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
    """(rows, origin, perm) of the longest block starting at the first row of ``local`` (source flat indices)."""
    dims = local.dim()
    if dims != len(shape):
        return None
    strides = [1] * dims
    for axis in range(dims - 2, -1, -1):
        strides[axis] = strides[axis + 1] * shape[axis + 1]
    origin_flat = int(local.reshape(-1)[0])
    origin = tuple((origin_flat // strides[a]) % shape[a] for a in range(dims))
    perm: list[int] = []
    for axis in range(dims):
        if local.shape[axis] > 1 and (axis > 0 or local.shape[0] > 1):
            step = [0] * dims
            step[axis] = 1
            diff = int(local[tuple(step)]) - origin_flat
            if diff in strides and (axis > 0 or int(which[1].reshape(-1)[0]) == src):
                perm.append(strides.index(diff))
            elif axis == 0:
                perm.append(-1)  # the next row is another block: this one is a single row
            else:
                return None
        else:
            perm.append(-1)
    free = [a for a in range(dims) if a not in perm]
    perm = [p if p >= 0 else free.pop(0) for p in perm]
    if sorted(perm) != list(range(dims)):
        return None
    # expected source index of every local element, under this origin and axis map
    grids = torch.meshgrid(*(torch.arange(n) for n in local.shape), indexing="ij")
    expected = torch.zeros(local.shape, dtype=torch.long) + origin_flat
    inside = torch.ones(local.shape, dtype=torch.bool)
    for axis in range(dims):
        coord = grids[axis] + origin[perm[axis]]
        inside &= coord < shape[perm[axis]]
        expected += grids[axis] * strides[perm[axis]]
    match = (expected == local) & inside & (which == src)
    row_ok = match.reshape(local.shape[0], -1).all(dim=1)
    count = int(row_ok.long().cumprod(0).sum())
    return (count, origin, tuple(perm)) if count else None
