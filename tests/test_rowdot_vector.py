"""aftgen.rowdot's vector kernel (the one for CPUs without AMX, and float32 weights), called with AMX left out:
a row's outputs are the same bits alone as in any batch, whatever its blocks of rows and outputs leave over,
and close to x @ wᵀ."""

from __future__ import annotations

import pytest
import torch

from aftgen import rowdot

WEIGHTS = {"float32": torch.float32, "bf16": torch.bfloat16}
OUTPUTS = [1, 17, 33]  # fewer than a block, and blocks with outputs left over
INPUTS = [1, 15, 40, 192]  # fewer than 16, 16s with inputs left over, whole 16s
ROWS = 33


def vector_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (N, K)ᵀ by the vector kernel alone → (M, N)."""
    y = x.new_empty(x.shape[0], w.shape[0])
    rowdot.library().aftgen_rowdot(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.dtype == torch.bfloat16,
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
