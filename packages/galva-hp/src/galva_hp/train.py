"""The training step, top to bottom: batch, forward and backward (schedule), clip, step, log."""

from __future__ import annotations

from torch import Tensor

from galva_hp.build import HybridParallelModel
from galva_hp.hooks import StepMetrics, Timer, peak_memory_mib
from galva_hp.optim import GalvaOptimizer

__all__ = ["train_step"]


def train_step(model: HybridParallelModel, optimizer: GalvaOptimizer, input_ids: Tensor, labels: Tensor) -> StepMetrics:
    """One optimizer step on the global batch (every rank passes the same ``input_ids`` and ``labels``)."""
    with Timer() as timer:
        optimizer.zero_grad()
        metrics = model.forward_backward(input_ids, labels)  # micro-batches, pipeline, gradient reduction
        metrics.lr = optimizer.lr
        metrics.grad_norm = optimizer.clip_grad_norm()  # by the true global norm
        optimizer.step()
        model.after_step()  # bf16: copy the fp32 masters back into the compute weights
    metrics.step_ms = timer.ms
    metrics.peak_memory_mib = peak_memory_mib()
    metrics.saved_activation_bytes = dict(model.saved_bytes)
    return metrics
