"""galva-hp: build this rank's part of a model under a per-layer hybrid-parallel Strategy, and train it.

model = tiny_gpt(...)                       # or a galva-models adapter: a LayeredModel
built = build(model, strategy, BuildOptions(seq_len=1024))
optimizer = GalvaOptimizer(built.param_records(), OptimConfig(lr=3e-4, warmup_steps=100, total_steps=10_000))
for input_ids, labels in batches:           # the same global batch on every rank
    metrics = train_step(built, optimizer, input_ids, labels)
"""

from galva_hp.build import BuildOptions, HybridParallelModel, build, check_plan
from galva_hp.hooks import StepMetrics, peak_memory_mib, saved_activation_meter
from galva_hp.labels import IGNORE_INDEX
from galva_hp.model import LayeredModel, ParallelContext, Parallelizer
from galva_hp.optim import GalvaOptimizer, OptimConfig, lr_factor, reference_optimizer
from galva_hp.precision import PrecisionPolicy
from galva_hp.train import train_step

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX",
    "BuildOptions",
    "GalvaOptimizer",
    "HybridParallelModel",
    "LayeredModel",
    "OptimConfig",
    "ParallelContext",
    "Parallelizer",
    "PrecisionPolicy",
    "StepMetrics",
    "build",
    "check_plan",
    "lr_factor",
    "peak_memory_mib",
    "reference_optimizer",
    "saved_activation_meter",
    "train_step",
]
