"""The matrix product every layer of the model runs, for weights kept in float32 or stored lower.

Training keeps every weight in float32 (autocast lowers the products on GPUs). Generation may store the
matrices in bf16 (`AFTLM.lower_weights`): a token's step reads every weight once, so half the bytes is up
to twice the speed, and a CPU with bf16 units multiplies them at twice the rate. Activations, biases, norms
and the recurrent state stay float32 either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weightᵀ + bias; with weights stored lower than float32, x multiplies in their dtype and the
    product comes back in float32."""
    if weight.dtype == torch.float32:
        return F.linear(x, weight, bias)
    product = F.linear(x.to(weight.dtype), weight).float()
    return product if bias is None else product + bias


class Linear(nn.Linear):
    """nn.Linear through `linear`: the same parameters and checkpoints, and weights that may be stored lower."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
