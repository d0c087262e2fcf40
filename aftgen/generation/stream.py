"""One generation's tokens in, its text out (TextStream): whole characters, held back before a stop string
(StopFilter); and the next tokens of many streams drawn as one batch (next_tokens)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aftgen.constraints import Matcher, compiled, masked
from aftgen.generation.context import Context, Histories
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.drawing import choose
from aftgen.tokenizer import Tokenizer


class StopFilter:
    """Holds back text that might be the start of a stop string; ends output before a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """One generation's tokens in, its text out: whole characters only, ending after max_new_tokens or
    before a stop string. `generate` drives one; a server drives many, stepping them as one batch.

    The caller asks `next_token()`, runs the model on it and hands the new logits to `accept`, which
    reads the token into the context before returning its text, so the context is consistent between
    any two calls.
    """

    def __init__(self, tokenizer: Tokenizer, context: Context, options: SamplingOptions, constraint: object = None):
        """`constraint`: options.constraint as constraints.compiled gave it, where the caller has it (a server
        compiles it before the request is admitted); else it is compiled here."""
        self.context, self.options = context, options
        self.decoder, self.stops = tokenizer.stream_decoder(), StopFilter(options.stop)
        self.matcher = None
        if options.constraint is not None:
            self.matcher = Matcher(constraint or compiled(options.constraint, tokenizer))
        self.produced = 0
        self.decoded = 0  # characters decoded so far, stop strings or not: where the next token's text starts

    def begin(self) -> str:
        """Text of a character an earlier run left unfinished (context.pending), now that it goes on."""
        self.context.pending, pending = b"", self.context.pending
        return self._shown(self.decoder.feed_bytes(pending))

    @property
    def stopped(self) -> bool:
        """Ended before the token limit: at a stop string, or with its constraint's text complete."""
        return self.stops.stopped or (self.matcher is not None and self.matcher.finished)

    @property
    def done(self) -> bool:
        limit = self.options.max_new_tokens
        return self.stopped or 0 <= limit <= self.produced

    def next_token(self) -> torch.Tensor:
        return next_tokens([self])

    def accept(self, token: int, logits: torch.Tensor) -> str:
        """Read `token` into the context, with the logits (1, vocab) the model gave after it."""
        self.produced += 1
        self.context.logits = logits
        self.context.remember((token,))
        if self.matcher is not None:
            self.matcher.advance(token)
        return self._shown(self.decoder.feed(token))

    def _shown(self, decoded: str) -> str:
        self.decoded += len(decoded)
        return self.stops.feed(decoded)

    def end(self, final: bool = True) -> str:
        """The text held back at the end. With final=False the run is to be continued later: a character
        the last token left unfinished stays in context.pending instead of becoming U+FFFD."""
        if self.stops.stopped:
            return ""
        if final:
            tail = self.decoder.flush()
        else:
            tail, self.context.pending = "", self.decoder.pending()
        return self.stops.feed(tail) + ("" if self.stops.stopped else self.stops.flush())


def next_tokens(streams: Sequence[TextStream], logits: torch.Tensor | None = None) -> torch.Tensor:
    """Each stream's next token (B,), drawn together in one pass, each from its own options, recent
    tokens and generator (see choose): ScoresNotFinite names streams by their index. `logits`: the streams'
    contexts' logits as one (B, vocab) tensor, where the caller has them so (a batch's step gives them)."""
    contexts = [stream.context for stream in streams]
    logits = torch.cat([context.logits for context in contexts]) if logits is None else logits
    return choose(
        masked(logits, [stream.matcher for stream in streams]),  # constrained rows' ruled-out tokens: -inf
        [stream.options for stream in streams],
        Histories(contexts),
        [context.generator for context in contexts],
    )
