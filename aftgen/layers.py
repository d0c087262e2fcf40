"""The matrix product every layer of the model runs, for weights kept in float32 or stored lower.

Training keeps every weight in float32 (autocast lowers the products on GPUs). Generation may store the
matrices in bf16 (`AFTLM.lower_weights`): a token's step reads every weight once, so half the bytes is up
to twice the speed, and a CPU with bf16 units multiplies them at twice the rate. Activations, biases, norms
and the recurrent state stay float32 either way.

One row at a time (a single stream's step) the product is a matrix-vector one, bound by reading the weights:
a CPU's bf16 matrix kernels then take longer than float32's (1.7 ms against 1.45 for the shipped model on one
core), though they read half the bytes. Compiled under `one_row_products()`, the product is written out as
the broadcast multiply and sum that it is, and the compiler fuses the widening of each weight into the one
pass that reads it (the old 7.9M-parameter shipped model's step: 1.0 ms on one core).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

_ONE_ROW = contextvars.ContextVar("one_row_products", default=False)


@contextlib.contextmanager
def one_row_products() -> Iterator[None]:
    """Within it, `linear` with lowered weights is written for one row of x, for a compiler to fuse (only
    for tracing: run eagerly, it would widen every weight in memory first)."""
    token = _ONE_ROW.set(True)
    try:
        yield
    finally:
        _ONE_ROW.reset(token)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weightᵀ + bias; with weights stored lower than float32, x multiplies in their dtype and the
    product comes back in float32."""
    if weight.dtype == torch.float32:
        return F.linear(x, weight, bias)
    x = x.to(weight.dtype)
    if _ONE_ROW.get():
        # A view of x as it is makes the compiler store x once (Inductor realizes as_strided's input),
        # rather than fold all that made it into the sum of every output. The numbers of the matrix kernels:
        # x and the weights in bf16, their products exact in float32, the sum rounded to bf16.
        x = x.as_strided(x.shape, x.stride(), x.storage_offset())
        product = (x.float().unsqueeze(-2) * weight.float()).sum(-1).to(weight.dtype)  # (..., 1, in) * (out, in)
    else:
        product = F.linear(x, weight)
    product = product.float()
    return product if bias is None else product + bias


class Linear(nn.Linear):
    """nn.Linear through `linear`: the same parameters and checkpoints, and weights that may be stored lower."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
