"""What the compiled step's tests share: a tiny model, its compile, prompts to step from, and checks that a step is
the eager one's (helpers of tests/compiled/, not a test module)."""

from __future__ import annotations

from unittest import mock

import torch
from conftest import no_compiler, on_device

from aftgen.compiled.step import compile_step
from aftgen.model import AFTLM, AFTConfig, clone_state

MAX_BATCH = 32


def tiny_model() -> AFTLM:
    torch.manual_seed(0)
    model = on_device(AFTLM(AFTConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=4, window=8, context_length=64)))
    with torch.no_grad():  # biases and decays away from their start, so the step's use of them shows
        for block in model.blocks:
            block.mixer.perturb_()
    return model.eval()


def compile_tiny() -> tuple[AFTLM, object]:
    """A tiny model and its step compiled for 1 to MAX_BATCH rows (a test module's one compile; from the cache after
    the first); where no compiler works, the test fails under AFTGEN_REQUIRE_COMPILER, else it is skipped."""
    model = tiny_model()
    step, note = compile_step(model, MAX_BATCH)
    if note.startswith("eager"):
        no_compiler(note)
    return model, step


def read_prompts(model: AFTLM, rows: int, seed: int = 0):
    """A state after a random prompt per row (read in the parallel form, as generation starts), and the
    tokens that follow."""
    generator = torch.Generator().manual_seed(seed)
    prompt, following = torch.randint(0, 50, (2, rows, 20), generator=generator)
    _, state = model.prefill(on_device(prompt), last_only=True)
    return state, on_device(following)


def no_eager_fallback(*args):
    raise AssertionError("the compiled step stepped eagerly")


def assert_states_close(state, expected) -> None:
    for layer, expected_layer in zip(state, expected, strict=True):
        assert layer.keys() == expected_layer.keys()
        for name in layer:
            torch.testing.assert_close(layer[name], expected_layer[name], rtol=1e-4, atol=1e-4, msg=name)


def assert_gives_the_eager_logits(model: AFTLM, step) -> None:
    """`step` is compiled (it never steps eagerly) and gives the eager step's logits."""
    state, following = read_prompts(model, 2)
    with torch.inference_mode():
        expected = model.step(following[:, 0], clone_state(state))[0]
        with mock.patch.object(model, "step", no_eager_fallback):
            logits = step(following[:, 0], clone_state(state))[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
