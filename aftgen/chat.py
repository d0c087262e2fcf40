"""Interactive generation: each line typed is read into the running state and the model replies.

The recurrent state carries the whole conversation, so no turn ever re-reads the history: a
thousandth turn costs what the first did. Ctrl-C stops the reply being written (the state keeps
what was written so far), Ctrl-C at the prompt gives a fresh prompt, Ctrl-D ends the session.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator

from aftgen.generation.context import Context
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.loop import generate
from aftgen.generation.prompt import read_prompt
from aftgen.model import AFTLM, StepFunction
from aftgen.tokenizer import Tokenizer, valid_text

# The chat format, `aftgen chat`'s and the server's alike: a user's message ends in a newline, and every other
# message, a reply included, in a blank line (a reply's default stop).
REPLY_END = "\n\n"
ENDINGS = {"system": REPLY_END, "developer": REPLY_END, "user": "\n", "assistant": REPLY_END}
ROLES = tuple(ENDINGS)


def message_text(role: str, content: str) -> str:
    """A message as the model reads it in the chat format."""
    return content + ENDINGS[role]


@contextlib.contextmanager
def interrupt_flag() -> Iterator[Callable[[], bool]]:
    """Inside the block, Ctrl-C (SIGINT) raises a flag instead of KeyboardInterrupt."""
    raised: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: raised.append(signum))
    try:
        yield lambda: bool(raised)
    finally:
        signal.signal(signal.SIGINT, previous)


def run_chat(
    model: AFTLM,
    tokenizer: Tokenizer,
    options: SamplingOptions,
    context: Context | None = None,
    step: StepFunction | None = None,
) -> Context | None:
    """Read lines from stdin until end of input, streaming each reply to stdout; return the final context.

    A line holding bytes that were not UTF-8 (lone surrogates, as `aftgen chat` reads stdin) is an AftgenError."""
    prompt = "> " if sys.stdin.isatty() and sys.stdout.isatty() else ""
    seed = options.seed  # seeds the first turn; later turns go on drawing from the same generator
    lines_read = 0
    while True:
        try:
            line = input(prompt)
        except EOFError:
            break
        except KeyboardInterrupt:  # at the prompt, as in a shell: start a fresh line
            print(file=sys.stderr)
            continue
        lines_read += 1
        valid_text(line, f"stdin line {lines_read}")
        with interrupt_flag() as interrupted:
            context = read_prompt(model, tokenizer, message_text("user", line), context, seed)
            seed = None
            for piece in generate(model, tokenizer, context, options, step):
                sys.stdout.write(piece)
                sys.stdout.flush()
                if interrupted():
                    print("\n[stopped]", file=sys.stderr)
                    break
        sys.stdout.write("\n")
        sys.stdout.flush()
    return context
