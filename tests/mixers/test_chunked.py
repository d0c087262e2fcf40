"""The chunked AFT form (aftgen/mixers/chunked.py): its hand-written backward is autograd's of the naive formula,
and AFTGEN_MIXER_KERNEL chooses between it and the fused kernels."""

from __future__ import annotations

import pytest
import torch
from conftest import on_device

from aftgen.errors import AftgenError
from aftgen.mixers import chunked
from aftgen.mixers.aft import aft_naive, aft_parallel, soft_cap
from aftgen.mixers.chunked import KERNEL_CHUNKS, KERNEL_VARIABLE, use_kernel


@pytest.mark.parametrize("s,T,chunk", [(5, 40, 8), (0, 21, 4), (4, 33, 4), (6, 13, 16)])
def test_hand_written_backward_matches_autograd_of_the_naive_formula(s, T, chunk):
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(2, T, 3, 4, generator=g) for _ in range(3)] + [
        torch.randn(3, s, generator=g),
        torch.rand(3, generator=g) * 0.3,
    ]
    inputs = [on_device(tensor) for tensor in inputs]
    weights = on_device(torch.randn(2, T, 3, 4, generator=g))  # a loss that weighs every output differently
    grads = []
    for mix in (lambda *a: aft_parallel(*a, chunk=chunk)[0], aft_naive):
        leaves = [t.double().requires_grad_() for t in inputs]
        q, k, v, w, decay = leaves
        (mix(q, soft_cap(k * 3), v, soft_cap(w * 2), decay) * weights).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for ours, reference in zip(*grads, strict=True):
        if reference is None:  # w has no entries when s == 0
            assert s == 0
            continue
        assert torch.allclose(ours, reference, atol=1e-9, rtol=1e-7)


def test_the_variable_chooses_the_form_and_long_windows_stay_in_pytorch(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # devices named only: nothing runs on them
    monkeypatch.delenv(KERNEL_VARIABLE, raising=False)
    assert use_kernel(cuda, 32) and not use_kernel(cpu, 32)  # auto: CUDA, as Triton is installed
    assert not use_kernel(cuda, KERNEL_CHUNKS[-1] + 1)
    monkeypatch.setenv(KERNEL_VARIABLE, "torch")
    assert not use_kernel(cuda, 32)
    monkeypatch.setenv(KERNEL_VARIABLE, "triton")
    assert use_kernel(cpu, 32) and not use_kernel(cpu, KERNEL_CHUNKS[-1] + 1)
    monkeypatch.setattr(chunked, "KERNELS_AVAILABLE", False)
    with pytest.raises(AftgenError, match="needs Triton"):
        use_kernel(cuda, 32)
    monkeypatch.setenv(KERNEL_VARIABLE, "fast")
    with pytest.raises(AftgenError, match="choose one of auto, triton, torch"):
        use_kernel(cpu, 32)
