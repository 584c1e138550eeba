"""Saving and loading a training run in the layerwise format, from and into any plan (galva-train's --save/--load).

Each rank knows, for every element of its master parameters, which Hugging Face tensor and which block of it the
element is (:func:`galva_hp.shard_map.shard_map` boxes, named on disk by
:func:`galva_models.checkpoint_names.checkpoint_names`; a box of a parameter stored as several on-disk tensors, the
experts of a mixture, is cut into one placement per on-disk tensor it meets). Saving hands those blocks (weights,
AdamW moments) to :func:`galva_ckpt.sharded.save_sharded`, which writes them in place into the per-module files;
loading reads the same blocks with slice reads from a Galva checkpoint or a Hugging Face directory. No rank ever
holds more than its own shards; a checkpoint saved under one plan loads under any other, because the files hold full
tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from galva_ckpt.errors import CheckpointError
from galva_ckpt.format import dtype_name, module_file, optimizer_file
from galva_ckpt.saves import prune, step_dir
from galva_ckpt.sharded import Piece, save_sharded
from galva_ckpt.sources import WeightSource, open_weights
from galva_hp.activation_checkpoint import unwrapped_name
from galva_hp.data_parallel import local_tensor
from galva_hp.model import LayeredModel
from galva_hp.optim import GalvaOptimizer
from galva_hp.runtime import HybridParallelModel
from galva_hp.shard_map import ShardBox, local_rows, shard_map
from galva_models.checkpoint_names import CheckpointNames, StoredPart
from galva_schema.checkpoint import TensorInfo
from galva_schema.vocabulary import layer_of_module

__all__ = ["MOMENTS", "CheckpointIO", "Placement"]

MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW state tensors saved per parameter (the step is one number, in the manifest)."""


@dataclass(frozen=True)
class Placement:
    """One block of this rank's local piece of a master parameter: local rows ``[start, stop)`` of the piece are
    ``box`` of the Galva parameter, and its sub-block ``offsets`` / ``sizes`` (the whole box, unless the parameter
    is stored as several tensors) is stored in module ``module`` as tensor ``tensor`` (as block ``part`` of the
    parameter; None: the parameter is that tensor, under another name at most)."""

    record: str
    start: int
    stop: int
    module: str
    tensor: str
    box: ShardBox
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    part: StoredPart | None = None

    @property
    def disk_offsets(self) -> tuple[int, ...]:
        return self.offsets if self.part is None else self.part.disk_offsets(self.offsets)

    @property
    def disk_sizes(self) -> tuple[int, ...]:
        return self.sizes if self.part is None else self.part.disk_sizes(self.sizes)

    @property
    def index(self) -> tuple[slice, ...]:
        """The block's slice of the on-disk tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.disk_offsets, self.disk_sizes))

    @property
    def within_box(self) -> tuple[slice, ...]:
        """The block's slice of the box (in the parameter's layout)."""
        return tuple(slice(o - b, o - b + s) for o, b, s in zip(self.offsets, self.box.offsets, self.sizes))


def _placements(record: str, start: int, stop: int, box: ShardBox, where: _Where) -> list[Placement]:
    """``box``'s placements: one, or one per on-disk tensor it meets for a parameter stored as several."""
    galva = unwrapped_name(box.source)
    if galva in where.whole:
        hf = where.whole[galva]
        return [Placement(record, start, stop, where.holder[hf], hf, box, box.offsets, box.sizes)]
    out = []
    module, parts = where.parts[galva]
    for part in parts:
        lo = [max(a, b) for a, b in zip(box.offsets, part.offsets)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(box.offsets, box.sizes, part.offsets, part.sizes)]
        if all(h > low for low, h in zip(lo, hi)):
            sizes = tuple(h - low for low, h in zip(lo, hi))
            out.append(Placement(record, start, stop, module, part.tensor, box, tuple(lo), sizes, part))
    return out


@dataclass(frozen=True)
class _Where:
    """Where each Galva parameter is stored: whole (Galva name -> on-disk name, on-disk name -> its module) or as
    blocks (Galva name -> its module and the blocks)."""

    whole: dict[str, str]
    holder: dict[str, str]
    parts: dict[str, tuple[str, tuple[StoredPart, ...]]]

    @classmethod
    def of(cls, names: CheckpointNames) -> _Where:
        return cls(
            {g: hf for m in names.modules for g, hf in m.galva_names.items()},
            {hf: m.name for m in names.modules for hf in m.shapes},
            {g: (m.name, parts) for m in names.modules for g, parts in m.parts.items()},
        )


class CheckpointIO:
    """Save and load for one built model and its optimizer (placements computed once, from ``fresh``)."""

    def __init__(
        self,
        model: HybridParallelModel,
        optimizer: GalvaOptimizer | None,
        names: CheckpointNames,
        fresh: LayeredModel,
        config: dict[str, Any],
        side_files: dict[str, bytes] | None = None,
    ) -> None:
        self.model, self.optimizer, self.names, self.config = model, optimizer, names, config
        # Hugging Face side files (the tokenizer) kept in every save, g2h writes them next to the weights: those of
        # the run's model directory, and over them those of the checkpoint it loads
        self.side_files = dict(side_files or {})
        self.params = {r.name: r.param for r in model.param_records()}
        where = _Where.of(names)
        self.placements: list[Placement] = []
        for record, boxes in shard_map(model, fresh).items():
            start, stop = local_rows(self.params[record])
            for box in boxes:
                cut = box.restrict(start, stop) if self.params[record].dim() else box
                if cut is not None:
                    self.placements += _placements(record, start, stop, cut, where)
        # persistent buffers (state Hugging Face saves that no optimizer updates): whole on every rank holding their
        # module, written once (the lowest holder), read back whole
        built = {unwrapped_name(name): buffer for name, buffer in model.named_buffers()}
        self.buffers = [(m.name, hf, built[g]) for m in names.modules for g, hf in m.buffers.items() if g in built]
        self.dtype = {p.tensor: self.params[p.record].dtype for p in self.placements}
        self.dtype.update({hf: buffer.dtype for _, hf, buffer in self.buffers})

    # ------------------------------------------------------------------------------------------------------ save
    def save(
        self,
        root: str | Path,
        step: int,
        scheduler: dict[str, Any] | None,
        keep_last: int = 0,
        family: str | None = None,
    ) -> dict[str, float]:
        """Save step ``step`` as ``<root>/step-<N>`` (collective); keep the newest ``keep_last`` saves.

        A save that cannot be written (a full disk) raises the same one-line :class:`CheckpointError` on every rank
        and leaves no temporary directory; the saves before it stay as they were."""
        model_infos, optimizer_infos = self._infos()
        pieces: list[tuple[Piece, Tensor]] = []
        for p in self.placements:
            param = self.params[p.record]
            pieces.append((_piece(module_file(p.module), p.tensor, p), self._block(param, p)))
            if self.optimizer is not None:
                state = self.optimizer.optimizer.state.get(param, {})
                for moment in MOMENTS:
                    value = state.get(moment)
                    if value is None:  # before the first step: zeros, as AdamW would start
                        value = torch.zeros_like(param)
                    piece = _piece(optimizer_file(p.module), f"{moment}/{p.tensor}", p)
                    pieces.append((piece, self._block(value, p)))
        for module, hf, buffer in self.buffers:
            whole = Piece(module_file(module), hf, (0,) * buffer.dim(), tuple(buffer.shape))
            pieces.append((whole, buffer.detach().contiguous()))
        opt = None
        if self.optimizer is not None:
            o = self.optimizer
            opt = {
                "step": step,
                "hyperparameters": {
                    "lr": o.config.lr,
                    "beta1": o.config.betas[0],
                    "beta2": o.config.betas[1],
                    "eps": o.config.eps,
                    "weight_decay": o.config.weight_decay,
                },
                "state_names": list(MOMENTS),
            }
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        finish = {
            "family": family or self.names.family,
            "config": self.config,
            "num_layers": sum(layer_of_module(m.name) is not None for m in self.names.modules),
            "tied": dict(self.names.tied),
            "step": step,
            "optimizer": opt,
            "scheduler": scheduler,
            "data_position": {"step": step},
            "mixed_precision": self.model.strategy.mixed_precision.value,  # a resume keeps it
        }
        # save_sharded creates the directories (on rank 0; a failure there is every rank's one-line CheckpointError)
        stats = save_sharded(
            step_dir(root, step), model_infos, optimizer_infos if opt else None, pieces, rng, finish, self.side_files
        )
        if dist.get_rank() == 0:
            prune(root, keep_last)
        dist.barrier()
        return stats

    def _infos(self) -> tuple[dict[str, dict[str, TensorInfo]], dict[str, dict[str, TensorInfo]]]:
        model: dict[str, dict[str, TensorInfo]] = {}
        optimizer: dict[str, dict[str, TensorInfo]] = {}
        dtypes = self._global_dtypes()
        for module in self.names.modules:
            buffers = set(module.buffers.values())
            model[module.name] = {
                hf: TensorInfo(shape=shape, dtype=dtypes.get(hf, "float32")) for hf, shape in module.shapes.items()
            }
            optimizer[module.name] = {
                f"{moment}/{hf}": TensorInfo(shape=shape, dtype=dtypes.get(hf, "float32"))
                for hf, shape in module.shapes.items()
                if hf not in buffers
                for moment in MOMENTS
            }
        return model, optimizer

    def _global_dtypes(self) -> dict[str, str]:
        """Every tensor's dtype (that of the master parameters holding it), agreed over the ranks."""
        mine = {name: dtype_name(dtype) for name, dtype in self.dtype.items()}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        merged: dict[str, str] = {}
        for part in everyone:
            merged.update(part)
        return merged

    @staticmethod
    def _block(value: Tensor, p: Placement) -> Tensor:
        local = local_tensor(value.detach())
        if local.dim() == 0:
            return local.reshape(())
        rows = local[p.box.rows[0] - p.start : p.box.rows[1] - p.start]
        block = p.box.to_source(p.box.cut(rows))
        if p.part is not None:
            block = p.part.to_disk(block[p.within_box])
        return block.contiguous()

    # ------------------------------------------------------------------------------------------------------ load
    def load(self, source: WeightSource, weights_only: bool = False) -> int:
        """Load weights (and, unless ``weights_only`` or the source has none, the optimizer, scheduler and RNG)
        into this rank's shards; returns the step to continue from (0 for weights only)."""
        self._check_shapes(source)
        self.side_files.update(source.read_side_files())
        with torch.no_grad():
            for p in self.placements:
                param = self.params[p.record]
                block = source.read_slice(p.tensor, p.index)
                self._put(param, p, block)
            for _, hf, buffer in self.buffers:
                buffer.copy_(source.read_slice(hf, tuple(slice(0, n) for n in buffer.shape)))
        self.model.sync_shared_weights()  # also refreshes bf16 compute copies from the masters
        manifest = source.manifest
        resume = not weights_only and manifest is not None and manifest.optimizer is not None
        if not resume or self.optimizer is None or manifest is None:
            return 0
        step = int(manifest.optimizer.step if manifest.optimizer is not None else 0)
        inner = self.optimizer.optimizer
        with torch.no_grad():
            for p in self.placements:
                param = self.params[p.record]
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(float(step))
                    for moment in MOMENTS:
                        state[moment] = torch.zeros_like(param, memory_format=torch.preserve_format)
                for moment in MOMENTS:
                    info = source.optimizer_info(p.tensor, moment)
                    if info is None:
                        raise CheckpointError(f"{source.where(p.tensor)}: no {moment} for tensor {p.tensor}")
                    self._put(state[moment], p, source.read_optimizer_slice(p.tensor, moment, p.index))
        if manifest.scheduler:
            _load_scheduler(self.optimizer, manifest.scheduler)
        rng = source.read_rng()
        mine = rng.get(f"rank{dist.get_rank()}/cpu", rng.get("rank0/cpu"))
        if mine is not None:
            torch.set_rng_state(mine)
        return int((manifest.data_position or {}).get("step", step))

    @staticmethod
    def _put(target: Tensor, p: Placement, block: Tensor) -> None:
        local = local_tensor(target)
        if local.dim() == 0:
            local.copy_(block.reshape(()))
            return
        place = p.box.to_source(p.box.cut(local[p.box.rows[0] - p.start : p.box.rows[1] - p.start]))
        if p.part is not None:
            place, block = place[p.within_box], p.part.from_disk(block, p.sizes)
        place.copy_(block)

    def _check_shapes(self, source: WeightSource) -> None:
        """Every tensor this rank needs is in the source with the model's full shape (one line otherwise)."""
        held = {p.tensor for p in self.placements} | {hf for _, hf, _ in self.buffers}
        for module in self.names.modules:
            for hf, shape in module.shapes.items():
                if hf not in held:
                    continue
                info = source.info(hf)
                if info is None:
                    raise CheckpointError(f"{source.where(hf)}: tensor {hf} missing (a checkpoint of another model?)")
                if tuple(info.shape) != tuple(shape):
                    raise CheckpointError(
                        f"{source.where(hf)}: tensor {hf} is {list(info.shape)}, the model needs {list(shape)}"
                    )


def _piece(file: str, tensor: str, p: Placement) -> Piece:
    return Piece(file, tensor, p.disk_offsets, p.disk_sizes)


def _load_scheduler(optimizer: GalvaOptimizer, state: dict[str, Any]) -> None:
    """Put the schedule at the saved step. Only the position comes from the checkpoint: the learning rates are the
    run's own schedule's at that step (the saved one, unless galva-train was told to override it; the saved last
    learning rate is the old schedule's, 0 at the end of a linear decay)."""
    scheduler = optimizer.scheduler
    step = int(state["last_epoch"])
    scheduler.last_epoch = step
    scheduler._step_count = int(state.get("_step_count", step + 1))
    lrs = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def scheduler_state(optimizer: GalvaOptimizer) -> dict[str, Any]:
    """The LambdaLR state as JSON (its lambdas are code: rebuilt from the run's flags, never saved)."""
    state = {k: v for k, v in optimizer.scheduler.state_dict().items() if k != "lr_lambdas"}
    json.dumps(state)
    return state


def open_source(path: str | Path) -> WeightSource:
    """:func:`galva_ckpt.sources.open_weights`, warning (once, on rank 0) about partial saves."""
    warn = not dist.is_initialized() or dist.get_rank() == 0
    return open_weights(path, warn=warn)
