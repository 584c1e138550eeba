"""The modules families build their :class:`galva_hp.model.LayeredModel` from: wrappers that hold Hugging Face
modules as they are (no copies, so the parameter-name mapping follows by tensor identity) and the heads with their
loss, ``(hidden, labels) -> (loss_sum, count)``.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from galva_hp import IGNORE_INDEX


def first_output(out: Any) -> Tensor:
    """Hugging Face layers return a tensor or a tuple whose first item is the hidden state."""
    return out[0] if isinstance(out, (tuple, list)) else out


def token_loss_sum(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Sum of fp32 cross-entropy over scored tokens (label != -100) and the number of scored tokens."""
    flat = labels.reshape(-1)
    loss_sum = F.cross_entropy(
        logits.reshape(flat.numel(), -1).float(), flat, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (flat != IGNORE_INDEX).sum()


class LMHead(nn.Module):
    """Final norm (optional) + output projection + token loss: ``(hidden, labels) -> (loss_sum, count)``."""

    def __init__(self, norm: nn.Module | None, lm_head: nn.Module, scale: float = 1.0) -> None:
        super().__init__()
        self.norm = norm if norm is not None else nn.Identity()
        self.lm_head = lm_head
        self.scale = scale  # T5 scales the decoder output by d_model**-0.5 when the head is tied

    def forward(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        hidden = self.norm(hidden)
        if self.scale != 1.0:
            hidden = hidden * self.scale
        return token_loss_sum(self.lm_head(hidden), labels)
