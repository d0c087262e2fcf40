"""OpenAI's response shapes: whole completions, stream chunks and `usage`, built from the engine's events."""

from __future__ import annotations

import collections
import functools
import json
import time
import uuid
from dataclasses import dataclass, field

from aftgen.sampling import read_score
from aftgen.serve.work import Event, Finished, Score, Started, Text
from aftgen.tokenizer import Tokenizer

as_json = json.JSONEncoder(separators=(",", ":")).encode  # one encoder: json.dumps with options makes one a call


FIGURE = "%.9g"  # a log-probability in JSON: the engine's float32 figure to 9 digits, which give it back exactly


class ScoreWriter:
    """OpenAI's `logprobs` JSON for one tokenizer, written by hand from its tokens' names made JSON once: a streamed
    token with `logprobs: 5` names six, and json.dumps of the same dicts costs the HTTP side twice the time. A
    token's alternatives are written by one `%` format (a template for each count of them), not a format a figure:
    the HTTP side shares the machine's cores with the engine, so its time a token slows every stream."""

    def __init__(self, tokenizer: Tokenizer):
        self.names = [as_json(tokenizer.token_text(token)) for token in range(tokenizer.vocab_size)]
        # chat: an entry's fields before its figure
        self.entries = [
            f'{{"token":{name},"bytes":{as_json(list(tokenizer.token_bytes(token)))},"logprob":'
            for token, name in enumerate(self.names)
        ]
        # tokens that share their text with another (a byte-fallback piece and a whole one): completions' top_logprobs
        # map text to figure, so of those only the likelier is named
        counts = collections.Counter(self.names)
        self.shared = {token for token, name in enumerate(self.names) if counts[name] > 1}
        self.templates: dict[tuple[bool, int], str] = {}

    def _template(self, chat: bool, count: int) -> str:
        """The `%` format of `count` alternatives, each a name (chat: an entry's start) and a figure."""
        if (chat, count) not in self.templates:
            one = f"%s{FIGURE}}}" if chat else f"%s:{FIGURE}"
            self.templates[chat, count] = ",".join([one] * count) if chat else f"{{{','.join([one] * count)}}}"
        return self.templates[chat, count]

    def _alternatives(self, chat: bool, ids: tuple[int, ...], values: tuple[float, ...]) -> str:
        named = self.entries if chat else self.names
        if not chat and not self.shared.isdisjoint(ids):  # the likelier (the earlier) of each text only
            kept = {}
            for other, value in zip(ids, values, strict=True):
                kept.setdefault(named[other], value)
            pairs = [part for pair in kept.items() for part in pair]
        else:
            pairs = [None] * (2 * len(ids))
            pairs[::2], pairs[1::2] = [named[other] for other in ids], values
        return self._template(chat, len(pairs) // 2) % tuple(pairs)

    def completions(self, scores: list[Score], top: int) -> str:
        """Completions' parallel lists; of an alternative's tokens with one text (a byte-fallback piece and a whole
        one), the likelier."""
        names, tokens, figures, tops = self.names, [], [], []
        for _, token, record in scores:
            logprob, ids, values = read_score(record, top)
            tokens.append(names[token])
            figures.append("null" if logprob is None else FIGURE % logprob)
            tops.append("null" if logprob is None else self._alternatives(False, ids, values))
        offsets = ",".join([str(start) for start, _, _ in scores])
        return (
            f'{{"tokens":[{",".join(tokens)}],"token_logprobs":[{",".join(figures)}],'
            f'"top_logprobs":[{",".join(tops)}],"text_offset":[{offsets}]}}'
        )

    def chat(self, scores: list[Score], top: int) -> str:
        """Chat's {"content": [entry with its "top_logprobs", ...]}."""
        content = []
        for _, token, record in scores:
            logprob, ids, values = read_score(record, top)
            figure = "null" if logprob is None else FIGURE % logprob
            content.append(f'{self.entries[token]}{figure},"top_logprobs":[{self._alternatives(True, ids, values)}]}}')
        return f'{{"content":[{",".join(content)}]}}'


@functools.lru_cache(maxsize=4)
def score_writer(tokenizer: Tokenizer) -> ScoreWriter:
    return ScoreWriter(tokenizer)


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
    tokenizer: Tokenizer | None = None  # where the request asked for logprobs: their tokens' names
    top: int = 0  # and how many alternatives a token it asked for
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    started: Started | None = None
    texts: dict[int, list[str]] = field(default_factory=dict)
    scores: dict[int, list[Score]] = field(default_factory=dict)
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
        scores: list[Score] | None = None,
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

    def _choice(self, index: int, scores: list[Score] | None, finish: str | None, body: dict) -> str:
        """A choice's JSON: its index, its `logprobs` (ScoreWriter), its finish and `body`."""
        logprobs = "null" if self.tokenizer is None or scores is None else self._logprobs(scores)
        return f'{{"index":{index},"logprobs":{logprobs},{as_json({"finish_reason": finish} | body)[1:]}'

    def _logprobs(self, scores: list[Score]) -> str:
        """OpenAI's `logprobs` of a choice or chunk, as JSON."""
        writer = score_writer(self.tokenizer)
        return writer.chat(scores, self.top) if self.chat else writer.completions(scores, self.top)

    def usage_chunk(self) -> str:
        """The last chunk when the client asked for stream_options.include_usage."""
        return f'{self._opening(stream=True)}],"usage":{as_json(self.usage())}}}'
