"""A step package run through its C interface (aftgen.compiled.aoti): it reads the model's own weights in place,
handed to it once, so another model of the architecture runs the same package, and weights changed in place after
compiling are what it reads."""

from __future__ import annotations

import copy

import pytest
import torch
from compiled_steps import MAX_BATCH, compile_tiny, no_eager_fallback, read_prompts

from aftgen.compiled.step import compile_step
from aftgen.model import clone_state


@pytest.fixture(scope="module")
def compiled():
    return compile_tiny()


def test_a_second_compile_loads_the_cached_step_and_reads_the_models_own_weights(compiled, monkeypatch):
    model, _ = compiled
    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1.5)
    step, note = compile_step(other, MAX_BATCH)  # the same architecture: the package from the fixture's compile
    assert note.startswith("compiled (from the cache)"), note
    eager = other.step
    monkeypatch.setattr(other, "step", no_eager_fallback)
    state, following = read_prompts(other, 2)
    fast, slow = clone_state(state), clone_state(state)
    with torch.inference_mode():
        torch.testing.assert_close(
            step(following[:, 0], fast)[0], eager(following[:, 0], slow)[0], rtol=1e-4, atol=1e-4
        )
        with torch.no_grad():
            other.embed.weight.add_(0.1)  # weights changed in place after compiling: the compiled step sees it
        torch.testing.assert_close(
            step(following[:, 1], fast)[0], eager(following[:, 1], slow)[0], rtol=1e-4, atol=1e-4
        )
