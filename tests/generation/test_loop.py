"""The token loop: a seeded generation repeats, stop strings cut it, and the compiled step generates what the
eager one does."""

from __future__ import annotations

import torch
from conftest import DEVICE, on_device

from aftgen.api import load
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.loop import generate
from aftgen.generation.prompt import read_prompt


def run_text(model, tokenizer, prompt: str, **options) -> str:
    options = SamplingOptions(**options)
    return "".join(generate(model, tokenizer, read_prompt(model, tokenizer, prompt, seed=options.seed), options))


def test_generation_is_seeded_and_stop_strings_cut_it(tiny):
    model, tokenizer = tiny
    first = run_text(model, tokenizer, "KING:", max_new_tokens=40, seed=3, temperature=1.0)
    assert first == run_text(model, tokenizer, "KING:", max_new_tokens=40, seed=3, temperature=1.0)
    assert first != run_text(model, tokenizer, "KING:", max_new_tokens=40, seed=4, temperature=1.0)
    stop = first[12:15]
    cut = run_text(model, tokenizer, "KING:", max_new_tokens=40, seed=3, temperature=1.0, stop=(stop,))
    assert cut == first[: first.find(stop)]


def test_compiled_step_generates_what_the_eager_step_does(tiny_run):
    """sample/chat --compile: the step through torch.compile gives the eager step's logits and states."""
    from aftgen.compiled.step import compile_step

    model, tokenizer = load(str(tiny_run), device=DEVICE)
    step, note = compile_step(model)
    assert step != model.step and note.startswith("compiled"), note
    fast = read_prompt(model, tokenizer, "KING: good night", seed=0)
    slow = read_prompt(model, tokenizer, "KING: good night", seed=0)
    with torch.inference_mode():
        for token in torch.randint(0, tokenizer.vocab_size, (40,), generator=torch.Generator().manual_seed(1)):
            fast_logits, _ = step(on_device(token.view(1)), fast.state)
            slow_logits, _ = model.step(on_device(token.view(1)), slow.state)
            torch.testing.assert_close(fast_logits, slow_logits, atol=1e-4, rtol=1e-4)
    for compiled_layer, eager_layer in zip(fast.state, slow.state, strict=True):
        for name in compiled_layer:
            torch.testing.assert_close(compiled_layer[name], eager_layer[name], atol=1e-4, rtol=1e-4, msg=name)
