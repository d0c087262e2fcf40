"""Functions through torch.compile, with an eager fallback that says why (aftgen.compiled.availability): the
prompt reader's chunks (compile_prefill) and training's step (aftgen.training.loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from aftgen.compiled.availability import decide, failure_line, fell_back
from aftgen.compiled.cache import use_persistent_compile_cache
from aftgen.model import AFTLM, PrefillFunction

PROMPT_READER, TRAINING_STEP = "torch.compile of the prompt reader", "torch.compile of the training step"
EAGER = "it runs eagerly"


def compile_prefill(model: AFTLM, length: int) -> tuple[PrefillFunction, str]:
    """`model.prefill` compiled for chunks of exactly `length` tokens at batch 1 continuing a state
    (how long texts are read), and a note of what happened. Use `model.prefill` for other shapes:
    each new shape would compile anew."""
    ids = torch.zeros(1, length, dtype=torch.long, device=model.embed.weight.device)

    def warm_up(prefill: Callable) -> None:
        _, state = model.prefill(ids, model.initial_state(1), last_only=True)  # a state like every later one
        prefill(ids, state, last_only=True)

    return _compiled(model.prefill, warm_up)


def _compiled(function: Callable, warm_up: Callable[[Callable], object]) -> tuple[Callable, str]:
    """`function` compiled into fused kernels and warmed up by `warm_up(compiled)`, or `function` itself
    where no compiler works (aftgen.compiled.availability says why); and a note of what happened.

    The compile (tens of seconds the first time, a few once PyTorch's on-disk cache holds it) is
    paid here, on scratch inputs, so it never lands inside a generation.
    """
    use_persistent_compile_cache()
    start = time.perf_counter()
    compiled = Compiled(function, PROMPT_READER, fullgraph=True, dynamic=False)
    with torch.inference_mode():  # the mode generation runs in: compiled graphs are specific to it
        warm_up(compiled)
    if compiled.failure is not None:
        return function, f"eager (torch.compile failed: {compiled.failure})"
    return compiled, f"compiled in {time.perf_counter() - start:.1f} s"


class Compiled:
    """`function` through torch.compile, or `function` itself where compiling fails.

    torch.compile is lazy, so a failure (no C++ compiler, an op it cannot trace) surfaces on the first
    call; that call is redone eagerly, and `failure` says why: decided, said and kept as every fallback is
    (aftgen.compiled.availability), the compiled function being `path`.
    """

    def __init__(self, function: Callable, path: str, **options) -> None:
        self.function, self.path = function, path
        self._compiled, verdict = decide(path, lambda: torch.compile(function, **options), EAGER)
        self.failure = verdict.reason  # a platform torch.compile does not support

    def __call__(self, *args, **kwargs):
        if self.failure is None:
            try:
                return self._compiled(*args, **kwargs)
            except Exception as exc:  # what a compiler raises has no common type: said and kept, never silent
                self.failure = fell_back(self.path, failure_line(exc), EAGER).reason
        return self.function(*args, **kwargs)
