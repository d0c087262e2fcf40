"""The batch-invariant matrix product: y = x @ wᵀ with every output summed in one order, however many rows x has.

The matrix libraries' kernels change how they split and order a product's sums with the number of rows (MKL's
float32 ones for any batch, oneDNN's bf16 ones past 32 rows), so the same row rounds differently alone and in a
batch, and a seeded request's text would depend on the requests beside it. matmul_rows.cpp sums output (m, n)
from row m of x and row n of w alone, in an order fixed by the machine and w's shape:

- with bf16 weights on a CPU with AMX, C^T = w xᵀ in 16 x 16 tiles, w's rows read in place as the tiles' A
  operand (no packing) and x rounded to bf16. Faster than the libraries at 1 row and at 32 (docs/benchmarks.md);
- otherwise 16 partial sums an output, input k into sum k mod 16, then a fixed tree, in register blocks of the
  machine's width (AVX-512, AVX2 or 128-bit): about MKL's float32 speed at 32 rows.

Its products run on one thread, as the batch-invariant step's other kernels do (aftgen.compiled.step.STEP_THREADS).
A step package calls it through AOTInductor's custom-op shims (SHIM), eager code through
`torch.ops.aftgen.matmul_rows`; the library is aftgen.native.library's.
"""

from __future__ import annotations

import torch

from aftgen.native.library import library

# How a step package calls it (AOTInductor's custom-op shims): the C declaration of matmul_rows.cpp's entry point.
SHIM = "AOTITorchError aoti_torch_cpu_matmul_rows(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0)"


def bf16_tiles() -> bool:
    """Whether bf16 weights multiply in AMX tiles here (else widened to float32 as they are read)."""
    return library().aftgen_matmul_rows_kernel(True, 16, 32) == b"amx"


def kernel(weight: torch.Tensor) -> str:
    """The kernel a weight (N, K) goes through on this machine: "amx" or "vector"."""
    is_bf16 = weight.dtype == torch.bfloat16
    return library().aftgen_matmul_rows_kernel(is_bf16, weight.shape[0], weight.shape[1]).decode()


@torch.library.custom_op("aftgen::matmul_rows", mutates_args=(), device_types="cpu")
def matmul_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 @ weight (N, K)ᵀ in float32 or bf16 → (M, N) float32, each output summed in one
    order whatever M is."""
    _check_operands(x, weight)
    x, weight = x.contiguous(), weight.contiguous()
    y = x.new_empty(x.shape[0], weight.shape[0])
    bf16 = weight.dtype == torch.bfloat16
    library().aftgen_matmul_rows(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), bf16, weight.shape[0],
                                 y.data_ptr(), 0)  # fmt: skip
    return y


@matmul_rows.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check_operands(x, weight)
    return x.new_empty(x.shape[0], weight.shape[0])


def _check_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    """What the C kernel reads: a float32 matrix x and a float32 or bf16 one of the same width."""
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "matmul_rows multiplies matrices")
    torch._check(x.dtype == torch.float32, lambda: f"matmul_rows takes x in float32, not {x.dtype}")
    torch._check(weight.dtype in (torch.float32, torch.bfloat16), lambda: f"matmul_rows's weight: not {weight.dtype}")
    torch._check(
        x.shape[1] == weight.shape[1], lambda: f"matmul_rows: x is {x.shape[1]} wide, the weight {weight.shape[1]}"
    )
