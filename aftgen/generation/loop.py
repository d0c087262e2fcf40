"""The token loop: text streamed from a context (generate), and a prompt's several continuations (sample_text)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from aftgen import cores
from aftgen.generation.context import Context
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.stream import TextStream
from aftgen.model import AFTLM, StepFunction
from aftgen.tokenizer import Tokenizer


@torch.inference_mode()
def generate(
    model: AFTLM,
    tokenizer: Tokenizer,
    context: Context,
    options: SamplingOptions,
    step: StepFunction | None = None,
    final: bool = True,
) -> Iterator[str]:
    """Stream text from a context, advancing it in place; `step` defaults to `model.step`.

    Yields only whole characters; ends after max_new_tokens or before a stop string. Each token is
    read into the context before its text is yielded, so leaving the loop at any point (Ctrl-C in
    chat) leaves a consistent context. With final=False the run is to be continued later (see TextStream.end).
    """
    step = step or model.step
    stream = TextStream(tokenizer, context, options)
    carried = stream.begin()
    if carried:
        yield carried
    while not stream.done:
        text = _next_text(stream, step)
        _keep_share_of_cores()
        if text:
            yield text
    if not stream.stops.stopped:  # a complete constraint's text may still be held back for a stop string
        yield stream.end(final)


def _next_text(stream: TextStream, step: StepFunction) -> str:
    """The stream's next token drawn, stepped through the model and read into its context; the text it shows."""
    token = stream.next_token()
    logits, _ = step(token, stream.context.state)
    return stream.accept(int(token), logits)


def _keep_share_of_cores() -> None:
    """Between two tokens, once each: this process's share of the CPU cores taken again when it is due, so that
    a long generation follows the other aftgen processes as they start and end (a clock read when nothing is)."""
    cores.adapt()


def sample_text(
    model: AFTLM,
    tokenizer: Tokenizer,
    context: Context,
    options: SamplingOptions,
    step: StepFunction | None = None,
    final: bool = True,
) -> Iterator[Iterator[str]]:
    """`options.num_samples` continuations of one context (a prompt read once by `read_prompt`, its state shared).

    One sample advances `context` itself (so the caller can save it); several each start from a copy.
    """
    options.check()
    several = options.num_samples > 1
    for _ in range(options.num_samples):
        yield generate(model, tokenizer, context.fork() if several else context, options, step, final)
