"""The fused Triton kernels (aftgen/mixers/fused.py) compute the naive formula: outputs, carried sums, gradients.

On a CPU the kernels run in Triton's interpreter, which a process must switch on before it defines
them: test_the_kernels_in_tritons_interpreter runs this file again in a fresh process with
TRITON_INTERPRET=1, where the parity tests run. With AFTGEN_TEST_DEVICE=cuda they run here, compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE

pytest.importorskip("triton")

from aftgen.errors import AftgenError  # noqa: E402
from aftgen.mixers.aft import AFTMixer, aft_naive, soft_cap  # noqa: E402
from aftgen.mixers.chunked import KERNEL_VARIABLE, aft_chunked, kernel_weights  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNELS_HERE = INTERPRETED or DEVICE.startswith("cuda")
KERNEL_DEVICE = "cpu" if INTERPRETED else DEVICE
kernels = pytest.mark.skipif(not KERNELS_HERE, reason="run by test_the_kernels_in_tritons_interpreter")
CHUNK = 16  # the kernels' smallest chunk: windows 0, 1 and the whole chunk below
SATURATED = 100.0  # keys scaled by this sit at the soft cap, +-KEY_CAP
# (T, window, decay, key scale): every window and decay at short lengths, then keys at the cap.
CASES = [(T, s, decay, 1.0) for T in (1, 15, 63) for s in (0, 1, CHUNK) for decay in (False, True)] + [
    (63, 1, True, SATURATED),
    (300, CHUNK, True, SATURATED),  # 19 chunks: the carried sum over many
]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}  # of the largest magnitude (or 1)


@pytest.fixture(autouse=True)
def exact_fp32():
    """No TF32 in the kernels' dots on a GPU (aftgen allows it for training; other tests may have switched it on)."""
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = allowed


def inputs(T: int, window: int, decay: bool, key_scale: float = 1.0, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v (2, T, 2, 20) with k soft-capped, w (2, window) soft-capped and lambda (2,), in float64.

    20 channels: two of the kernels' blocks of 16, the second cut off by its mask. Values are
    rounded through fp16 so that every precision reads the very same numbers.
    """
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, T, 2, 20, generator=g, dtype=torch.float64) for _ in range(3))
    k = soft_cap(k * key_scale)
    w = soft_cap(2 * torch.randn(2, window, generator=g, dtype=torch.float64))
    lam = 0.5 * torch.rand(2, generator=g, dtype=torch.float64) if decay else torch.zeros(2, dtype=torch.float64)
    return [x.half().double() for x in (q, k, v)] + [w.float().double(), lam.float().double()]


def scaled_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    if not expected.numel():
        return 0.0
    return ((got.double().cpu() - expected).abs().max() / expected.abs().max().clamp(min=1)).item()


@kernels
@pytest.mark.parametrize("T, window, decay, key_scale", CASES)
def test_outputs_and_every_gradient_match_the_naive_formula(T, window, decay, key_scale):
    from aftgen.mixers.fused import aft_fused

    exact = [x.requires_grad_() for x in inputs(T, window, decay, key_scale)]
    expected = aft_naive(*exact)
    grad_y = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected_grads = torch.autograd.grad(expected, exact, grad_y, allow_unused=True, materialize_grads=True)
    for dtype in (torch.float32, torch.float16):  # the interpreter has no bf16 dot
        q, k, v = (x.detach().to(KERNEL_DEVICE, dtype).requires_grad_() for x in exact[:3])
        w, decay_ = (x.detach().to(q.device, torch.float32).requires_grad_() for x in exact[3:])
        y = aft_fused(q, k, v, *kernel_weights(w, decay_, CHUNK))
        grads = torch.autograd.grad(y, (q, k, v, w, decay_), grad_y.to(y.device, y.dtype), materialize_grads=True)
        tolerance = TOLERANCE[dtype]
        assert y.dtype == dtype and scaled_error(y, expected.detach()) < tolerance
        for name, got, want in zip(("q", "k", "v", "w", "decay"), grads, expected_grads, strict=True):
            assert scaled_error(got, want) < tolerance, (dtype, name, scaled_error(got, want))


@kernels
@pytest.mark.parametrize("window, decay", [(0, True), (1, False), (CHUNK, True)])
def test_the_carried_sums_are_every_older_token_decayed(window, decay):
    """S_n, carried into chunk n: sum of exp(k) (v, 1) over the tokens before chunk n - 1, each weighted
    exp(-lambda (its distance to the end of chunk n - 2))."""
    from aftgen.mixers.fused import carried_sums

    q, k, v, w, lam = inputs(63, window, decay)
    got = carried_sums(
        *(x.to(KERNEL_DEVICE, torch.float32) for x in (q, k, v)),
        *kernel_weights(w.to(KERNEL_DEVICE, torch.float32), lam.to(KERNEL_DEVICE, torch.float32), CHUNK),
    )
    for n in range(got.shape[2]):
        end = max((n - 1) * CHUNK, 0)
        age = end - torch.arange(end, dtype=torch.float64)
        weight = torch.exp(k[:, :end] - lam[None, None, :, None] * age[None, :, None, None])  # (B, end, H, D)
        expected = torch.stack([(weight * v[:, :end]).sum(1), weight.sum(1)], dim=2)  # (B, H, 2, D)
        assert scaled_error(got[:, :, n], expected) < TOLERANCE[torch.float32], n


@kernels
def test_the_mixer_trains_alike_through_either_form(monkeypatch):
    """AFTMixer's forward and every parameter's gradient, the fused kernels against the PyTorch form."""
    torch.manual_seed(0)
    mixer = AFTMixer(n_embd=32, n_head=2, window=8, context_length=64, decay=True)
    mixer.perturb_()
    mixer, x = mixer.to(KERNEL_DEVICE), torch.randn(2, 40, 32, device=KERNEL_DEVICE)
    results = {}
    for form in ("torch", "triton"):
        monkeypatch.setenv(KERNEL_VARIABLE, form)
        mixer.zero_grad()
        y, _ = mixer(x)
        y.square().sum().backward()
        results[form] = [y.detach()] + [p.grad.clone() for p in mixer.parameters()]
    for got, want in zip(results["triton"], results["torch"], strict=True):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max().clamp(min=1)


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="torch.compile cannot trace kernels Triton interprets")
def test_torch_compile_traces_through_the_kernels(monkeypatch):
    """The kernels are torch.library ops: a whole-graph compile of the mixer takes them in, forward and backward."""
    monkeypatch.setenv(KERNEL_VARIABLE, "triton")
    torch.manual_seed(0)
    mixer = AFTMixer(n_embd=32, n_head=2, window=4, context_length=32, decay=True).to(KERNEL_DEVICE)
    x = torch.randn(1, 20, 32, device=KERNEL_DEVICE, requires_grad=True)
    compiled = torch.compile(mixer, backend="aot_eager", fullgraph=True)
    eager_grad, compiled_grad = (torch.autograd.grad(run(x)[0].sum(), x)[0] for run in (mixer, compiled))
    assert (compiled_grad - eager_grad).abs().max() < 1e-5


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels' tests run in this process")
def test_the_kernels_in_tritons_interpreter():
    env = os.environ | {"TRITON_INTERPRET": "1", "AFTGEN_TEST_DEVICE": "cpu"}
    command = [sys.executable, "-m", "pytest", __file__, "-x", "-p", "no:cacheprovider"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= len(CASES) + 3, done.stdout[-2000:]


@pytest.mark.skipif(INTERPRETED, reason="in the interpreter the kernels do run on the CPU")
def test_forcing_the_kernels_onto_a_cpu_tensor_says_what_to_do(monkeypatch):
    monkeypatch.setenv(KERNEL_VARIABLE, "triton")
    q, k, v, w, lam = (x.float() for x in inputs(8, 2, True))
    with pytest.raises(AftgenError, match="unset AFTGEN_MIXER_KERNEL"):
        aft_chunked(q, k, v, w, lam)
