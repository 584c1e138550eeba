"""The saved-tensor meter counts activations only: parameters and views of parameters are model states."""

from __future__ import annotations

import torch
from torch import nn

from galva_hp.hooks import saved_activation_meter


def test_linear_weight_view_is_not_an_activation() -> None:
    layer = nn.Linear(8, 16, bias=False)  # its matmul saves the input and weight.t(), a view of the parameter
    x = torch.randn(3, 8, requires_grad=True)
    with saved_activation_meter() as meter:
        out = layer(x)
    assert meter.bytes == x.numel() * 4  # the input only, not the 16x8 weight
    out.sum().backward()
    assert layer.weight.grad is not None
