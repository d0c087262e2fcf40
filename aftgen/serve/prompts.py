"""Where a request's prompt starts reading, and what reading it leaves in the prefix cache.

A fresh prompt goes on from the longest prefix of it the cache holds, a session's turn from the session's context;
a fresh prompt once read, and a chat's reply read as text, are kept in the cache for the requests that extend them
(the cache's docstring says which states it keeps).
"""

from __future__ import annotations

from aftgen.errors import AftgenError
from aftgen.generation.context import Context
from aftgen.generation.prompt import PromptReader, opening
from aftgen.model import AFTLM
from aftgen.serve.cache import PrefixCache
from aftgen.serve.options import ServeOptions
from aftgen.serve.rows import Reader, Row
from aftgen.serve.sessions import SessionStore
from aftgen.serve.work import Echo, Failed, Ticket
from aftgen.tokenizer import Tokenizer


class Prompts:
    """The engine's prompts: read by its model in --prompt-chunk pieces, through its prefix cache (None: none) and
    its sessions (`busy`: the sessions a turn is reading, generating or saving, which a request cannot continue)."""

    def __init__(
        self,
        model: AFTLM,
        tokenizer: Tokenizer,
        options: ServeOptions,
        cache: PrefixCache | None,
        sessions: SessionStore,
        busy: set[str],
    ):
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.cache, self.sessions, self.busy = cache, sessions, busy

    def start(self, ticket: Ticket) -> Reader | Failed:
        """Where the request's prompt starts reading: a session's context, a cached prefix, or nothing."""
        work = ticket.work
        if work.session is None:
            score = work.logprobs if work.echo else None  # the echo's scores need every position's logits
            prompt = self.reader(opening(self.tokenizer, work.prompt, None), None, work.options.seed, score)
            return Reader(ticket, prompt, cached=0 if score is not None else self.from_cache(prompt))
        if work.session in self.busy:
            message = f"session '{work.session}' is busy with another request; send the next one when it has finished"
            return Failed(409, message, "invalid_request_error", "session_busy")
        try:
            context = self.sessions.get(work.session)  # None: a new session starts like a fresh prompt
        except AftgenError as exc:  # a damaged file, or one another model wrote
            return Failed(400, f"session '{work.session}' cannot be continued: {exc}", "invalid_request_error")
        self.busy.add(work.session)
        ids = opening(self.tokenizer, work.prompt, context)
        return Reader(ticket, self.reader(ids, context, work.options.seed))

    def reader(
        self, ids: list[int], context: Context | None = None, seed: int | None = None, score: int | None = None
    ) -> PromptReader:
        """A reader of `ids` into `context` (None: a fresh one) in --prompt-chunk pieces. One the cache may keep (a
        fresh prompt's, read without scores: those read every position's logits, which round otherwise) marks
        where its last piece starts."""
        marks = self.cache is not None and context is None and score is None
        piece = self.options.prompt_chunk
        return PromptReader(self.model, ids, context, seed, score=score, piece=piece, mark=marks)

    def from_cache(self, prompt: PromptReader) -> int:
        """Start `prompt` after the longest prefix of it the cache holds that ends one of its pieces, or after
        all of it; returns that prefix's length."""
        hit = self.cache.lookup(prompt.ids) if self.cache else None
        if hit is None:
            return 0
        prompt.skip(hit.state, hit.logits, hit.tokens)
        return hit.tokens

    def echo(self, reader: Reader) -> Echo:
        """The prompt as the client gave it: its text and, with logprobs, its tokens' scores (a BOS read first has
        none)."""
        given = reader.ticket.work.prompt
        text, starts = text_starts(self.tokenizer, given)
        if reader.prompt.score is None:
            return Echo(text)
        scores = reader.prompt.scores[len(reader.prompt.ids) - len(given) :]
        return Echo(text, [(start, *score) for start, score in zip(starts, scores, strict=True)])

    def remember_reply(self, row: Row) -> None:
        """Cache the conversation as the client will send it next: the prompt, then the reply read as text.

        The reply's own tokens need not be how the tokenizer spells its text, and a client sends text;
        reading it now (a short parallel pass) means the next turn reads only its new message and this
        conversation's last piece (the cache's docstring says why).
        """
        reply = "".join(row.parts) + row.ticket.work.reply_suffix
        prompt = self.reader(row.prompt + self.tokenizer.encode(reply))
        cached = self.from_cache(prompt)
        prompt.read()
        self.keep(prompt, cached)

    def keep(self, prompt: PromptReader, cached: int) -> None:
        """Cache a fresh prompt read past what the cache held: the state after it, and where its last piece starts
        (a longer prompt starting with it can go on from there alone: the cache's docstring says why)."""
        if self.cache is None or not prompt.mark:
            return
        if prompt.last_start is not None and prompt.last_start[0] > cached:
            start, state, logits = prompt.last_start
            self.cache.put(prompt.ids[:start], state, logits)
        if cached < len(prompt.ids):
            self.cache.put(prompt.ids, prompt.context.state, prompt.context.logits)


def text_starts(tokenizer: Tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """The text of `ids`, and where each one's text starts in it."""
    decoder, parts, starts, length = tokenizer.stream_decoder(), [], [], 0
    for token in ids:
        starts.append(length)
        parts.append(decoder.feed(token))
        length += len(parts[-1])
    return "".join(parts) + decoder.flush(), starts
