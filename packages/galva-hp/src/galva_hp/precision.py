"""Mixed precision: which dtype the compute weights use, and in which dtype gradients are reduced.

bf16 runs compute in bf16 with fp32 master weights (kept by the data-parallel units, updated by the optimizer); the
gradient reduction is fp32 by default (``reduce_in_fp32``) or bf16 to halve its traffic. fp16 would need loss
scaling and is rejected when a model is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from galva_schema import Precision

__all__ = ["PrecisionPolicy"]


@dataclass(frozen=True)
class PrecisionPolicy:
    """``param_dtype``: compute weights and activations; ``reduce_dtype``: gradient reduction."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @classmethod
    def from_precision(cls, precision: Precision, reduce_in_fp32: bool = True) -> PrecisionPolicy:
        if precision is Precision.FP32:
            return cls()
        if precision is Precision.BF16:
            return cls(torch.bfloat16, torch.float32 if reduce_in_fp32 else torch.bfloat16)
        raise ValueError(f"mixed_precision: {precision.value} needs loss scaling, which galva-hp does not do; use bf16")

    @property
    def low_precision(self) -> bool:
        return self.param_dtype != torch.float32
