"""Functions through torch.compile, with an eager fallback that says why: the prompt reader's chunks
(compile_prefill) and training's step (aftgen.training.loop).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from aftgen.compiled.cache import use_persistent_compile_cache
from aftgen.model import AFTLM, PrefillFunction


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
    where no compiler works; and a note of what happened.

    The compile (tens of seconds the first time, a few once PyTorch's on-disk cache holds it) is
    paid here, on scratch inputs, so it never lands inside a generation.
    """
    use_persistent_compile_cache()
    start = time.perf_counter()
    compiled = Compiled(function, fullgraph=True, dynamic=False)
    with torch.inference_mode():  # the mode generation runs in: compiled graphs are specific to it
        warm_up(compiled)
    if compiled.failure is not None:
        return function, f"eager (torch.compile failed: {compiled.failure})"
    compiled.warn = _said_on_stderr  # a later compile that fails (a shape not warmed up on) falls back, said
    return compiled, f"compiled in {time.perf_counter() - start:.1f} s"


def _said_on_stderr(failure: str) -> None:
    print(f"warning: torch.compile failed, running eagerly: {failure}", file=sys.stderr, flush=True)


class Compiled:
    """`function` through torch.compile, or `function` itself where compiling fails.

    torch.compile is lazy, so a failure (no C++ compiler, an op it cannot trace) surfaces on the first
    call; that call is redone eagerly, `failure` says why, and `warn` (if given) hears it once.
    """

    def __init__(self, function: Callable, warn: Callable[[str], None] | None = None, **options) -> None:
        self.function, self.warn = function, warn
        self.failure: str | None = None
        try:
            self._compiled = torch.compile(function, **options)
        except Exception as exc:  # a platform torch.compile does not support
            self._fall_back(exc)

    def __call__(self, *args, **kwargs):
        if self.failure is None:
            try:
                return self._compiled(*args, **kwargs)
            except Exception as exc:  # no C++ compiler, an unsupported op, ...: eager always works
                self._fall_back(exc)
        return self.function(*args, **kwargs)

    def _fall_back(self, exc: Exception) -> None:
        self.failure = failure_line(exc)
        if self.warn is not None:
            self.warn(self.failure)


def failure_line(exc: Exception) -> str:
    """Why compiling failed, in one line: the exception's type and the first line of its message."""
    first_line = next(iter(str(exc).strip().splitlines()), "")
    return f"{type(exc).__name__}: {first_line[:200]}" if first_line else type(exc).__name__
