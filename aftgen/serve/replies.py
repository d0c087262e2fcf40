"""OpenAI's response shapes: whole completions, stream chunks and `usage`, built from the engine's events."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from aftgen.generation.scores import read_scores
from aftgen.native.scores_json import UNIT, scores_json
from aftgen.serve.work import Echo, Event, Failed, Finished, Started, Text, Ticket, TokenScores
from aftgen.tokenizer import Tokenizer

as_json = json.JSONEncoder(separators=(",", ":")).encode  # one encoder: json.dumps with options makes one a call


FIGURE = "%.9g"  # a log-probability in JSON: the engine's float32 figure to 9 digits, which give it back exactly
# A token's scores as a reply writes them: where its text starts, then completions' name, figure (or null) and
# {name: figure, ...} map (or null), or chat's whole entry, each JSON.
ScoresJSON = tuple[int, str, str, str] | tuple[int, str]


class ScoresWriter:
    """Tokens' scores written as OpenAI's `logprobs` JSON, for one tokenizer, from its tokens' names made JSON once: a
    streamed token with `logprobs: 5` names six, and json.dumps of the same dicts costs the HTTP side twice the time.
    All the tokens of a turn's events go through the native library in one call (scores_json.cpp) where it can be
    had: the HTTP side shares the machine's cores with the engine, so its time a token slows every stream."""

    def __init__(self, tokenizer: Tokenizer, native: bool = True):
        """`native`: through the library where it can be had (the same JSON); else, and with False, in Python."""
        self.names = [as_json(tokenizer.token_text(token)) for token in range(tokenizer.vocab_size)]
        # chat: an entry's fields before its figure
        self.entries = [
            f'{{"token":{name},"bytes":{as_json(list(tokenizer.token_bytes(token)))},"logprob":'
            for token, name in enumerate(self.names)
        ]
        self.native = scores_json(self.names, self.entries) if native else None

    def write(self, asks: list[tuple[bool, int, list[TokenScores]]]) -> list[list[ScoresJSON]]:
        """Each ask's scores as JSON (chat's shape or completions', with at most `top` alternatives a token)."""
        if self.native is None:
            return [[(start, *self._json(chat, top, token, record)) for start, token, record in scores]
                    for chat, top, scores in asks]  # fmt: skip
        texts = iter(self.native([(token, top, chat, record) for chat, top, scores in asks
                                  for _, token, record in scores]))  # fmt: skip
        return [[(start, next(texts)) if chat else (start, *next(texts).split(UNIT)) for start, _, _ in scores]
                for chat, _, scores in asks]  # fmt: skip

    def _json(self, chat: bool, top: int, token: int, record: str) -> tuple[str, ...]:
        logprob, ids, values = read_scores(record, top)
        if not all(0 <= other < len(self.names) for other in (token, *ids)):  # as the library refuses them
            raise ValueError(f"a score record names a token outside the vocabulary of {len(self.names)}")
        figure = "null" if logprob is None else FIGURE % logprob
        if chat:
            pairs = zip(ids, values, strict=True)
            alternatives = ",".join([f"{self.entries[other]}{FIGURE % value}}}" for other, value in pairs])
            return (f'{self.entries[token]}{figure},"top_logprobs":[{alternatives}]}}',)
        # of alternatives with one text (a byte-fallback piece and a whole one), the likelier
        named: dict[str, str] = {}
        for other, value in zip(ids, values, strict=True):
            named.setdefault(self.names[other], f"{self.names[other]}:{FIGURE % value}")
        return self.names[token], figure, "null" if logprob is None else f"{{{','.join(named.values())}}}"


def completions_logprobs(scores: list[ScoresJSON]) -> str:
    """Completions' parallel lists."""
    offsets = ",".join([str(score[0]) for score in scores])
    return (
        f'{{"tokens":[{",".join([score[1] for score in scores])}],'
        f'"token_logprobs":[{",".join([score[2] for score in scores])}],'
        f'"top_logprobs":[{",".join([score[3] for score in scores])}],"text_offset":[{offsets}]}}'
    )


def chat_logprobs(scores: list[ScoresJSON]) -> str:
    """Chat's {"content": [entry with its "top_logprobs", ...]}."""
    return f'{{"content":[{",".join([score[1] for score in scores])}]}}'


@functools.lru_cache(maxsize=4)
def scores_writer(tokenizer: Tokenizer) -> ScoresWriter:
    return ScoresWriter(tokenizer)


# How a request's scores are written: chat's shape or not, and how many alternatives a token (None: none asked)
ScoresAsked = Callable[[Ticket], tuple[bool, int] | None]


def scores_as_json(
    events: list[tuple[Ticket, Event]], tokenizer: Tokenizer, asked: ScoresAsked
) -> list[tuple[Ticket, Event]]:
    """The events with each Text's or Echo's TokenScores replaced by their JSON as its request `asked`, every token
    of them in one pass. A record that cannot be read (an engine's fault) fails its own request, not the others
    delivered with it."""
    asks = [(at, shape, event) for at, (ticket, event) in enumerate(events)
            if isinstance(event, Text | Echo) and event.scores and (shape := asked(ticket))]  # fmt: skip
    if not asks:
        return events
    events, wanted = list(events), [(chat, top, event.scores) for _, (chat, top), event in asks]
    try:
        written = scores_writer(tokenizer).write(wanted)
    except Exception:  # each request alone, to find whose record it is
        written = [_scores_alone(tokenizer, *ask) for ask in wanted]
    for (at, _, event), scores in zip(asks, written, strict=True):
        ticket = events[at][0]
        events[at] = (ticket, msgspec.structs.replace(event, scores=scores) if scores is not None else UNREADABLE)
    return events


# what a request whose scores cannot be written gets instead (the HTTP side cancels it: the engine goes on otherwise)
UNREADABLE = Failed(500, "the generation process sent scores that cannot be read", "server_error")


def _scores_alone(tokenizer: Tokenizer, chat: bool, top: int, scores: list[TokenScores]) -> list[ScoresJSON] | None:
    try:
        return scores_writer(tokenizer).write([(chat, top, scores)])[0]
    except Exception:  # unreadable, whatever the reason
        return None


def usage(started: Started | None, completion_tokens: int) -> dict:
    prompt = started.prompt_tokens if started else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": started.cached_tokens if started else 0},
    }


@dataclass
class Reply:
    """One response under construction: its id and header fields, and what the events said so far."""

    chat: bool
    model: str
    scored: bool = False  # the request asked for logprobs: its Text events' scores are JSON (scores_as_json)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    started: Started | None = None
    texts: dict[int, list[str]] = field(default_factory=dict)
    scores: dict[int, list[ScoresJSON]] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)
    openings: dict[bool, str] = field(default_factory=dict)  # _opening's, streamed or not

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def take(self, event: Event) -> None:
        if isinstance(event, Started):
            self.started = event
        elif isinstance(event, Text):
            self.texts.setdefault(event.index, []).append(event.text)
            self.scores.setdefault(event.index, []).extend(event.scores or ())
        elif isinstance(event, Finished):
            self.finished[event.index] = event

    def usage(self) -> dict:
        return usage(self.started, sum(finish.tokens for finish in self.finished.values()))

    def _header(self, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self) -> str:
        """The non-streaming response's JSON, every choice in index order."""
        choices = []
        for index in sorted(self.finished):
            content = "".join(self.texts.get(index, []))
            body = {"message": {"role": "assistant", "content": content}} if self.chat else {"text": content}
            choices.append(self._choice(index, self.scores.get(index, []), self.finished[index].reason, body))
        return f'{self._opening(stream=False)}{",".join(choices)}],"usage":{as_json(self.usage())}}}'

    def chunk(
        self,
        index: int,
        text: str | None = None,
        finish: str | None = None,
        first: bool = False,
        scores: list[ScoresJSON] | None = None,
    ) -> str:
        """A stream chunk's JSON for one choice: its text (with its tokens' `scores`), its first (chat: the role)
        or its finish."""
        if self.chat:
            body = {
                "delta": {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            }
        else:
            body = {"text": text or ""}
        choice = self._choice(index, (scores or []) if text is not None else None, finish, body)
        return f"{self._opening(stream=True)}{choice}]}}"

    def _opening(self, stream: bool) -> str:
        """The response's JSON up to its first choice: the header fields, then `"choices":[` (made once)."""
        if stream not in self.openings:
            self.openings[stream] = f'{as_json(self._header(stream))[:-1]},"choices":['
        return self.openings[stream]

    def _choice(self, index: int, scores: list[ScoresJSON] | None, finish: str | None, body: dict) -> str:
        """A choice's JSON: its index, its `logprobs` (scores as JSON), its finish and `body`."""
        logprobs = "null" if not self.scored or scores is None else self._logprobs(scores)
        return f'{{"index":{index},"logprobs":{logprobs},{as_json({"finish_reason": finish} | body)[1:]}'

    def _logprobs(self, scores: list[ScoresJSON]) -> str:
        """OpenAI's `logprobs` of a choice or chunk, as JSON."""
        return chat_logprobs(scores) if self.chat else completions_logprobs(scores)

    def usage_chunk(self) -> str:
        """The last chunk when the client asked for stream_options.include_usage."""
        return f'{self._opening(stream=True)}],"usage":{as_json(self.usage())}}}'
