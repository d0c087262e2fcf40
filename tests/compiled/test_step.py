"""The compiled step (aftgen.compiled.step.compile_step) is the eager step, faster: the same logits and states at every
batch size it serves, the model's own weights, and the eager step wherever it cannot serve."""

from __future__ import annotations

import copy

import pytest
import torch
from compiled_steps import MAX_BATCH, assert_states_close, compile_tiny, no_eager_fallback, read_prompts, tiny_model
from conftest import no_compiler

from aftgen.compiled.step import compile_step, loaded_runner, step_constants, step_package
from aftgen.layers import linear, written_products
from aftgen.model import clone_state


@pytest.fixture(scope="module")
def compiled():
    """The one compile of this file: a tiny model's step for 1 to 32 rows."""
    return compile_tiny()


@pytest.mark.parametrize("rows", [1, 3, MAX_BATCH])
def test_compiled_step_gives_the_eager_logits_and_a_state_that_continues_alike(compiled, rows, monkeypatch):
    model, step = compiled
    eager = model.step
    monkeypatch.setattr(model, "step", no_eager_fallback)  # every step below is the compiled one's own
    state, following = read_prompts(model, rows, seed=rows)
    fast, slow = clone_state(state), clone_state(state)
    with torch.inference_mode():
        for t in range(10):
            fast_logits, _ = step(following[:, t], fast)
            slow_logits, _ = eager(following[:, t], slow)
            assert fast_logits.shape == (rows, 50)
            torch.testing.assert_close(fast_logits, slow_logits, rtol=1e-4, atol=1e-4)
        assert_states_close(fast, slow)
        for t in range(10, 20):  # the compiled step's state read on by the eager step, and the other way round
            torch.testing.assert_close(
                eager(following[:, t], fast)[0], step(following[:, t], slow)[0], rtol=1e-4, atol=1e-4
            )
    assert_states_close(fast, slow)


def test_written_products_give_what_the_matrix_kernels_give():
    """Written out for a compiler (layers.written_products), a product with bf16 weights still multiplies x
    rounded to bf16, as the matrix kernels do: only the order of the float32 sum may differ."""
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(1, 96, generator=generator), torch.randn(40, 96, generator=generator), torch.randn(40)
    weight = weight.bfloat16()
    with written_products():
        written_out = linear(x, weight, bias)
    by_the_kernels = linear(x, weight, bias)
    assert written_out.dtype == torch.float32
    torch.testing.assert_close(written_out, by_the_kernels, rtol=2**-7, atol=1e-5)  # one bf16 step at most
    # and rarely even that: x left in float32 would move about a third of them
    assert (written_out != by_the_kernels).float().mean() < 0.1


@pytest.mark.parametrize("rows", [1, 3])
def test_bf16_weights_step_through_their_own_one_row_package_with_the_eager_logits(rows, monkeypatch):
    """With weights stored in bf16 a single row has a package of its own (layers.written_products), and
    every row count still gives the eager step's logits, as closely as a sum in another order rounded to bf16
    allows."""
    model = tiny_model().lower_weights(torch.bfloat16)
    step, note = compile_step(model, 4)
    if note.startswith("eager"):
        no_compiler(note)
    assert step.one_row is not step.rows
    eager = model.step
    monkeypatch.setattr(model, "step", no_eager_fallback)
    state, following = read_prompts(model, rows)
    fast, slow = clone_state(state), clone_state(state)
    with torch.inference_mode():
        for t in range(5):
            torch.testing.assert_close(
                step(following[:, t], fast)[0], eager(following[:, t], slow)[0], rtol=1e-2, atol=1e-2
            )


def test_torchs_loader_the_gpus_path_runs_the_package_on_another_models_weights(compiled):
    """The path a GPU takes (torch's loader, the weights handed over as constants), run here on the package
    the CPU's runner runs, for another model of the architecture."""
    model, step = compiled
    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(0.8)
    path, origin = step_package(other, MAX_BATCH)
    assert origin == " (from the cache)"
    run = loaded_runner(path, step_constants(other))
    state, following = read_prompts(other, 3)
    fast, slow = clone_state(state), clone_state(state)
    names = list(fast[0])
    with torch.inference_mode():
        for t in range(3):
            ids = following[:, t].contiguous()
            logits = run([ids, *(layer[name] for layer in fast for name in names)])[0]
            torch.testing.assert_close(logits, other.step(ids, slow)[0], rtol=1e-4, atol=1e-4)
    assert_states_close(fast, slow)


def test_batches_and_states_the_package_was_not_compiled_for_step_eagerly(compiled):
    model, step = compiled
    state, following = read_prompts(model, MAX_BATCH + 1)
    with torch.inference_mode():
        logits, _ = step(following[:, 0], clone_state(state))  # one row more than compiled for
        torch.testing.assert_close(logits, model.step(following[:, 0], clone_state(state))[0])
        strided = [
            {
                name: t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() > 1 else t
                for name, t in layer.items()
            }
            for layer in clone_state(state)
        ]
        logits, _ = step(following[:, 0], strided)  # the same values, laid out otherwise
        torch.testing.assert_close(logits, model.step(following[:, 0], clone_state(state))[0])


def test_the_step_falls_back_to_eager_where_compiling_fails(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(torch.export, "export", no_compiler)
    model = tiny_model()
    step, note = compile_step(model, 2)  # a batch range not compiled before: the cache has no package for it
    assert step == model.step
    assert note == "eager (compiling the step failed: RuntimeError: no C++ compiler found)"
