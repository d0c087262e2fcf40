"""aftgen.native.matmul_rows, the batch-invariant product: a row's outputs are the same bits alone as among any
other rows, and close to x @ wᵀ, through the kernel the machine picks and through the vector kernel alone (the one
for CPUs without AMX, and float32 weights), whatever its blocks of rows and outputs leave over; operands the
kernel cannot read are refused."""

from __future__ import annotations

import pytest
import torch

from aftgen.native import library
from aftgen.native.matmul_rows import kernel, matmul_rows

WEIGHTS = {"float32": torch.float32, "bf16": torch.bfloat16}
SHAPES = [(576, 192), (192, 768), (33, 64), (17, 40), (1, 15)]  # (outputs, inputs): tiles, and tails of each


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_a_rows_product_alone_is_the_same_bits_as_among_other_rows(weights, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=generator).to(WEIGHTS[weights])
    x = torch.randn(33, shape[1], generator=generator)
    together = matmul_rows(x, w)
    for rows in (1, 2, 5, 16, 17, 32):
        for start in (0, 1, 33 - rows):
            assert torch.equal(matmul_rows(x[start : start + rows], w), together[start : start + rows]), (rows, start)
    inputs = x.bfloat16() if kernel(w) == "amx" else x  # AMX multiplies bf16 by bf16
    expected = inputs.double() @ w.double().T
    torch.testing.assert_close(together.double(), expected, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


BAD_OPERANDS = {
    "a float16 weight": (torch.randn(2, 8), torch.randn(4, 8).half(), "weight"),
    "a float64 x": (torch.randn(2, 8).double(), torch.randn(4, 8), "float32"),
    "other widths": (torch.randn(2, 8), torch.randn(4, 9), "8 wide"),
    "a vector": (torch.randn(8), torch.randn(4, 8), "matrices"),
}


@pytest.mark.parametrize("case", BAD_OPERANDS)
def test_operands_the_kernel_cannot_read_are_refused_not_read(case):
    x, weight, named = BAD_OPERANDS[case]
    with pytest.raises(RuntimeError, match=named):
        matmul_rows(x, weight)


OUTPUTS = [1, 17, 33]  # fewer than a block, and blocks with outputs left over
INPUTS = [1, 15, 40, 192]  # fewer than 16, 16s with inputs left over, whole 16s
ROWS = 33


def vector_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (N, K)ᵀ by the vector kernel alone → (M, N)."""
    y = x.new_empty(x.shape[0], w.shape[0])
    library.library().aftgen_matmul_rows(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.dtype == torch.bfloat16,
                                    w.shape[0], y.data_ptr(), 1)  # fmt: skip
    return y


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("outputs", OUTPUTS)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_a_rows_vector_product_is_the_same_bits_in_any_batch(weights, outputs, inputs):
    generator = torch.Generator().manual_seed(outputs * 1000 + inputs)
    w = torch.randn(outputs, inputs, generator=generator).to(WEIGHTS[weights])
    x = torch.randn(ROWS, inputs, generator=generator)
    alone = torch.cat([vector_product(x[m : m + 1], w) for m in range(ROWS)])
    for rows in range(1, ROWS + 1):
        for start in sorted({0, 1, 3, ROWS - rows}):
            if start + rows <= ROWS:
                batch = vector_product(x[start : start + rows], w)
                assert torch.equal(batch, alone[start : start + rows]), (rows, start)
    expected = x.double() @ w.double().T
    torch.testing.assert_close(alone.double(), expected, rtol=0, atol=1e-6 * inputs + 1e-6)
