"""Per-layer data parallelism over each layer's own sharding group.

- ``ddp``: parameters replicated on the sharding group; gradients accumulate locally over the micro-batches and are
  all-reduced (SUM) once per iteration, one bucket per unit launched asynchronously from the last micro-batch's
  backward (:mod:`galva_hp.grad_buckets`), or after every micro-batch on request.
- ``zero2`` / ``zero3``: FSDP2 ``fully_shard`` on a one-dimensional mesh made from the layer's sharding group.
  zero3 frees the gathered parameters after forward (and re-gathers them for backward); zero2 keeps them until the
  backward is done. Parameters, gradients and optimizer states are stored as 1/dp shards in both. FSDP2
  reduce-scatters a layer's gradients in its backward, only in the iteration's last micro-batch
  (``set_requires_gradient_sync(False)`` on the earlier ones, which accumulate unsharded gradients).

Gradients are always *summed* over the group: the loss every rank back-propagates is already divided by the global
token count, so a sum gives exactly the gradient of the global mean loss (FSDP2's default would average).

In bf16 a unit computes with bf16 parameters and keeps fp32 master parameters for the optimizer: FSDP2 does this
with its mixed-precision policy (sharded fp32 parameters, bf16 gathered copies); a ddp unit keeps fp32 copies
itself and copies them back into the bf16 module after every optimizer step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from galva_hp.precision import PrecisionPolicy
from galva_schema import DataParallelType

__all__ = ["DataParallelUnit", "DdpUnit", "FsdpUnit", "ParamRecord", "local_tensor", "wrap"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a (possibly DTensor) parameter or gradient."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class ParamRecord:
    """One master parameter and how often its local piece is replicated over the world (for the global norm)."""

    name: str
    param: nn.Parameter  # the fp32 master parameter the optimizer updates (a DTensor for zero2/zero3)
    replicas: int  # ranks holding an identical copy of this rank's local piece


class DataParallelUnit(ABC):
    """One module wrapped for data parallelism on ``group`` (None: a single-rank group).

    ``reduce_every_micro_batch`` reduces gradients after every micro-batch backward instead of only the last one.
    ``exclude`` names parameters of ``module`` that another unit holds (a layer's experts, over their own group).
    """

    dp_type: DataParallelType

    def __init__(
        self,
        name: str,
        module: nn.Module,
        group: dist.ProcessGroup | None,
        precision: PrecisionPolicy,
        reduce_every_micro_batch: bool = False,
        exclude: frozenset[str] = frozenset(),
    ):
        self.name = name
        self.module = module
        self.group = group
        self.precision = precision
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.exclude = exclude

    def own_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of the trainable parameters this unit holds (not those of ``exclude``)."""
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and n not in self.exclude]

    @property
    def group_size(self) -> int:
        return 1 if self.group is None else self.group.size()

    def before_backward(self, sync: bool) -> None:  # noqa: B027 - optional hook, empty by default
        """Called before each micro-batch backward; ``sync`` marks the backward after which gradients are reduced."""

    def begin_split_backward(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Called before the input pass of a split backward (zero-bubble schedules)."""

    def before_weight_backward(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Called before the weight pass of a split backward."""

    def finish_split_backward(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Called after the weight pass that completes this unit's gradients (or every one, when reducing every
        micro-batch) of a split backward."""

    def after_backward(self, sync: bool) -> None:  # noqa: B027 - optional hook, empty by default
        """Called after each micro-batch backward."""

    @abstractmethod
    def master_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, fp32 master parameter) pairs the optimizer updates."""

    @abstractmethod
    def replicas_over_dp(self) -> int:
        """How many ranks of the sharding group hold the same local piece of a parameter."""

    def after_step(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Called after every optimizer step (copy master weights back into compute weights)."""


class DdpUnit(DataParallelUnit):
    """Replicated parameters; gradients summed over the group once per iteration (see :mod:`galva_hp.grad_buckets`)."""

    dp_type = DataParallelType.DDP

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        module, precision = self.module, self.precision
        self._params = self.own_parameters()
        if precision.low_precision:
            # fp32 masters for the optimizer, bf16 compute weights in the module
            self._masters = [(n, nn.Parameter(p.detach().float().clone())) for n, p in self._params]
            _to_dtype(module, precision.param_dtype, {n.rpartition(".")[0] for n in self.exclude})
            self._params = self.own_parameters()
        else:
            self._masters = self._params
        self._reduced: list[torch.Tensor | None] | None = None  # per-micro-batch reduction accumulator

    def master_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._masters)

    def replicas_over_dp(self) -> int:
        return self.group_size

    def grads_to_reduce(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(compute parameter, master parameter) pairs whose gradient must be summed over the group."""
        return [(p, m) for (_, p), (_, m) in zip(self._params, self._masters)]

    def after_backward(self, sync: bool) -> None:
        if not self.reduce_every_micro_batch:
            return
        # reduce this micro-batch's contribution now and keep the sum aside, so later backwards start from zero
        grads = [p.grad for _, p in self._params]
        present = [g for g in grads if g is not None]
        if present:
            all_reduce_flat(present, self.group, self.precision.reduce_dtype)
        if self._reduced is None:
            self._reduced = [None] * len(grads)
        for i, (_, p) in enumerate(self._params):
            if p.grad is None:
                continue
            previous = self._reduced[i]
            self._reduced[i] = p.grad if previous is None else previous + p.grad
            p.grad = None
        if sync:
            for i, (_, p) in enumerate(self._params):
                p.grad = self._reduced[i]
            self._reduced = None

    def move_grads_to_masters(self) -> None:
        """After reduction: hand the (fp32) gradients to the master parameters."""
        if self._masters is self._params:
            return
        for (_, p), (_, m) in zip(self._params, self._masters):
            if p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
            p.grad = None

    def after_step(self) -> None:
        if self._masters is self._params:
            return
        with torch.no_grad():
            for (_, p), (_, m) in zip(self._params, self._masters):
                p.copy_(m)


def _to_dtype(module: nn.Module, dtype: torch.dtype, skipped: set[str]) -> None:
    """``module.to(dtype)``, leaving the submodules ``skipped`` (another unit's, with their own precision) alone."""
    if not skipped:
        module.to(dtype)
        return
    for path, sub in module.named_modules():
        if path in skipped:
            continue
        for param in sub.parameters(recurse=False):
            param.data = param.data.to(dtype)
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer.is_floating_point():
                sub._buffers[name] = buffer.to(dtype)


class FsdpUnit(DataParallelUnit):
    """ZeRO-2 / ZeRO-3 through FSDP2 ``fully_shard`` on a mesh built from the sharding group."""

    def __init__(self, dp_type: DataParallelType, *args: Any, **kwargs: Any):
        """``dp_type`` (zero2 or zero3), then :class:`DataParallelUnit`'s arguments."""
        super().__init__(*args, **kwargs)
        self.dp_type = dp_type
        name, module, group, precision = self.name, self.module, self.group, self.precision
        if group is None:
            raise ValueError(f"{name}: {dp_type.value} needs a sharding group of more than one rank")
        device_type = next((p.device.type for p in module.parameters()), "cpu")
        mesh = DeviceMesh.from_group(group, device_type)
        policy = MixedPrecisionPolicy(
            param_dtype=precision.param_dtype if precision.low_precision else None,
            reduce_dtype=precision.reduce_dtype if precision.low_precision else None,
        )
        ignored = {p for n, p in module.named_parameters() if n in self.exclude} or None
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=dp_type is DataParallelType.ZERO3,
            mp_policy=policy,
            ignored_params=ignored,
        )
        assert isinstance(module, FSDPModule)
        module.set_gradient_divide_factor(1.0)  # sum, not mean: the loss is already divided globally
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        self.fsdp: FSDPModule = module
        # id of each gathered (unsharded) parameter -> its name: it is what forward sees, and the name finds the shard
        self.unsharded_names: dict[int, str] = {}
        module.register_forward_pre_hook(self._note_unsharded)  # after FSDP2's own pre-hook, which gathers

    def _note_unsharded(self, module: nn.Module, args: object) -> None:
        if not self.unsharded_names:
            self.unsharded_names = {id(p): n for n, p in module.named_parameters()}

    def sharded_parameter(self, unsharded: nn.Parameter) -> nn.Parameter | None:
        """The sharded parameter (at rest) of a gathered one seen in forward; None if it is not this unit's."""
        name = self.unsharded_names.get(id(unsharded))
        return None if name is None else self.module.get_parameter(name)

    def before_backward(self, sync: bool) -> None:
        self.fsdp.set_requires_gradient_sync(sync or self.reduce_every_micro_batch)

    def begin_split_backward(self) -> None:
        """Before a split backward's input pass: keep the gathered parameters and their gradients (the weight pass
        writes them later, outside FSDP2's autograd hooks) until :meth:`finish_split_backward`."""
        self.fsdp.set_requires_gradient_sync(False)
        self.fsdp.set_reshard_after_backward(False)

    def before_weight_backward(self) -> None:
        """Before a weight pass: a later micro-batch's forward may have resharded (zero3) what it reads."""
        self.fsdp.unshard()

    def finish_split_backward(self) -> None:
        """After the weight pass that completes the gradients: reduce-scatter them and reshard, as FSDP2's
        post-backward would (``torch.distributed.pipelining`` does the same through FSDP2's private state)."""
        fsdp = self.fsdp
        fsdp.set_is_last_backward(True)
        fsdp.set_requires_gradient_sync(True)
        fsdp.set_reshard_after_backward(True)
        state = fully_shard.state(fsdp)  # type: ignore[attr-defined]
        for each in state._state_ctx.all_states:
            for param_group in each._fsdp_param_groups:
                param_group.post_backward()
        state._root_post_backward_final_callback()

    def master_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.own_parameters()

    def replicas_over_dp(self) -> int:
        return 1


def wrap(
    name: str,
    module: nn.Module,
    dp_type: DataParallelType,
    group: dist.ProcessGroup | None,
    precision: PrecisionPolicy,
    reduce_every_micro_batch: bool = False,
    exclude: frozenset[str] = frozenset(),
) -> DataParallelUnit:
    """Wrap ``module`` for data parallelism of type ``dp_type`` over ``group`` (``exclude``: parameters another unit
    holds).

    On a one-rank group there is nothing to shard or reduce, so every type is the plain (replicated) unit.
    """
    if dp_type is DataParallelType.DDP or group is None or group.size() == 1:
        return DdpUnit(name, module, group, precision, reduce_every_micro_batch, exclude)
    return FsdpUnit(dp_type, name, module, group, precision, reduce_every_micro_batch, exclude)


def all_reduce_flat(grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None, dtype: torch.dtype) -> None:
    """Sum ``grads`` over ``group`` in place (blocking), through one flat buffer per dtype, reduced in ``dtype``."""
    if group is None or group.size() == 1:
        return
    # one buffer per dtype keeps the number of collectives (and their latency) at one per group
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_dtype[g.dtype].append(g)
    for tensors in by_dtype.values():
        flat = _flatten_dense_tensors(tensors)
        work = flat.to(dtype) if flat.dtype != dtype else flat
        dist.all_reduce(work, group=group)
        if work is not flat:
            flat.copy_(work)
        for g, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            g.copy_(reduced)
