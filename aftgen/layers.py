"""The matrix product every layer of the model runs, for weights kept in float32 or stored lower.

Training keeps every weight in float32 (autocast lowers the products on GPUs). Generation may store the
matrices in bf16 (`AFTLM.lower_weights`): a token's step reads every weight once, so half the bytes is up
to twice the speed, and a CPU with bf16 units multiplies them at twice the rate. Activations, biases, norms
and the recurrent state stay float32 either way.

One row at a time (a single stream's step) the product is a matrix-vector one, bound by reading the weights:
a CPU's bf16 matrix kernels then take longer than float32's, though they read half the bytes. Compiled
under `written_products()`, the product is written out as the broadcast multiply and sum that it is, and the
compiler fuses the widening of each weight into the one pass that reads it, faster than either kernel
(figures: docs/benchmarks.md, "Figures behind the code's choices").

The matrix kernels change the order of their products' sums with the number of rows
(MKL's float32 ones for any batch; oneDNN's bf16 ones past 32 rows, or at other sizes), so a row's logits
would depend on the rows beside it. Under `invariant_products()` (the batch-invariant step, aftgen.compiled
.step.compile_step) every product goes through aftgen.native.matmul_rows instead, which sums each row in one order
alone or among any others.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aftgen.native.library import decided
from aftgen.native.matmul_rows import matmul_rows

KERNELS, WRITTEN, ROWS_APART = "kernels", "written out", "rows apart"  # how `linear` multiplies (_products)


class _Products(threading.local):
    """How `linear` multiplies in this thread (a server exports its step in one thread while it steps eagerly in
    another). A plain attribute, not a context variable: torch.compile reads it once, as it traces, and bakes the
    choice into the graph (a ContextVar's get is a call it cannot trace, and the whole graph fell back to eager)."""

    mode = KERNELS


_PRODUCTS = _Products()
BATCH_INVARIANT_HELP = (
    "Make a row's numbers the same whatever else shares the step, so a seeded request gives the same text alone "
    "or beside others. Default: on for a compiled step on a CPU, whatever the weights' dtype and the CPU's units, "
    "unless a server, timing its compiled step at start, finds it over 10% slower than the matrix kernels' (one line "
    "then says so); off on a GPU (its products written out) and for the eager step (rows stepped apart)."
)
# The most the batch-invariant step may take against the matrix kernels' step, at 1 row or at a batch, for it to
# stay the default: beyond it a server is faster without it, and says so.
SLOWER_AT_MOST = 1.10


@dataclass(frozen=True)
class Invariance:
    """Whether the step is batch-invariant; where it is not, why (one line: what a server reports); and whether it
    is so by default, to be confirmed by timing the compiled step against the other (aftgen.serve.batch)."""

    on: bool
    reason: str | None = None
    by_default: bool = False


def batch_invariant(asked: bool | None, device: torch.device, compiled: bool) -> Invariance:
    """--batch-invariant as given; else on for a compiled step on a CPU, whatever the weights' dtype and the
    CPU's units (a server then times it against the matrix kernels' step: `judged`). Off on a GPU, whose
    products it writes out, for the eager step, whose rows it steps one at a time, and where the native
    library cannot be built (one line says why)."""
    if asked is not None:
        return Invariance(asked, None if asked else "--no-batch-invariant")
    if device.type != "cpu":
        return Invariance(False, "a GPU's step is batch-invariant only when asked (--batch-invariant)")
    if not compiled:
        return Invariance(False, "the eager step is batch-invariant only when asked (--batch-invariant)")
    _, native = decided()  # built and loaded now: where it cannot be, the step is the matrix kernels', not rows apart
    if not native.usable:  # said in one line (aftgen.compiled.availability)
        return Invariance(False, native.reason)
    return Invariance(True, by_default=True)


def judged(times: dict[int, tuple[float, float]]) -> Invariance:
    """The default confirmed by timing: on unless, at some number of rows, the batch-invariant step's time
    (`times`: rows -> (its seconds, the matrix kernels' step's)) is over SLOWER_AT_MOST times the other's; then
    off, said in one line on stderr with what it costs."""
    rows, (invariant, kernels) = max(times.items(), key=lambda item: item[1][0] / item[1][1])
    if invariant <= SLOWER_AT_MOST * kernels:
        return Invariance(True, by_default=True)
    reason = (
        f"it took {invariant / kernels:.2f}x the matrix kernels' step here at {rows} row"
        f"{'s' * (rows > 1)} ({invariant * 1e3:.2f} against {kernels * 1e3:.2f} ms)"
    )
    print(f"warning: the step is not batch-invariant: {reason}; --batch-invariant makes a seeded request's text "
          f"the same alone and among others at that cost", file=sys.stderr, flush=True)  # fmt: skip
    return Invariance(False, reason, by_default=True)


@contextlib.contextmanager
def _products(mode: str) -> Iterator[None]:
    """Within it, in this thread, `linear` multiplies as `mode` says."""
    before, _PRODUCTS.mode = _PRODUCTS.mode, mode
    try:
        yield
    finally:
        _PRODUCTS.mode = before


def written_products() -> contextlib.AbstractContextManager[None]:
    """Within it, `linear` is written out as a multiply and a sum over the input, for a compiler to fuse (only
    for tracing: run eagerly, it would make every product in memory first)."""
    return _products(WRITTEN)


def invariant_products() -> contextlib.AbstractContextManager[None]:
    """Within it, `linear` multiplies through aftgen.native.matmul_rows: a row's product is the same alone or in a
    batch."""
    return _products(ROWS_APART)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weightᵀ + bias; with weights stored lower than float32, x multiplies in their dtype and the
    product comes back in float32."""
    mode = _PRODUCTS.mode  # read once as a compiler traces: the graph multiplies one way
    if mode == ROWS_APART:
        rows = x.reshape(-1, x.shape[-1]).float()
        product = matmul_rows(rows, weight).view(*x.shape[:-1], weight.shape[0])
    elif mode == WRITTEN:
        product = _written_product(x.to(weight.dtype), weight)
    elif weight.dtype == torch.float32:
        return F.linear(x, weight, bias)
    else:
        product = F.linear(x.to(weight.dtype), weight)
    product = product.float()
    return product if bias is None else product + bias


def _written_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weightᵀ as the multiply and the sum over the input that it is, in the weight's dtype."""
    # A view of x as it is makes the compiler store x once (Inductor realizes as_strided's input), rather than
    # fold all that made it into the sum of every output.
    x = x.as_strided(x.shape, x.stride(), x.storage_offset())
    return (x.float().unsqueeze(-2) * weight.float()).sum(-1).to(weight.dtype)


class Linear(nn.Linear):
    """nn.Linear through `linear`: the same parameters and checkpoints, and weights that may be stored lower."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
