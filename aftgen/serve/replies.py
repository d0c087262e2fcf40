"""OpenAI's response shapes: whole completions, stream chunks and `usage`, built from the engine's events."""

from __future__ import annotations

import functools
import json
import time
import uuid
from dataclasses import dataclass, field

from aftgen.sampling import read_score
from aftgen.serve.work import Event, Finished, Score, Started, Text
from aftgen.tokenizer import Tokenizer

as_json = json.JSONEncoder(separators=(",", ":")).encode  # one encoder: json.dumps with options makes one a call


def number(logprob: float | None) -> str:
    """A log-probability in JSON: the engine's float32 figure to 9 digits, which give it back exactly (and cost a
    third of the time repr takes to write the 17 of the figure widened to a double)."""
    return "null" if logprob is None else f"{logprob:.9g}"


class ScoreWriter:
    """OpenAI's `logprobs` JSON for one tokenizer, written by hand from its tokens' names made JSON once: a streamed
    token with `logprobs: 5` names six, and json.dumps of the same dicts costs the HTTP side twice the time."""

    def __init__(self, tokenizer: Tokenizer):
        self.names = [as_json(tokenizer.token_text(token)) for token in range(tokenizer.vocab_size)]
        # chat: an entry's fields before its figure
        self.entries = [
            f'{{"token":{name},"bytes":{as_json(list(tokenizer.token_bytes(token)))},"logprob":'
            for token, name in enumerate(self.names)
        ]

    def completions(self, scores: list[Score], top: int) -> str:
        """Completions' parallel lists; of an alternative's tokens with one text (a byte-fallback piece and a whole
        one), the likelier."""
        names, tokens, figures, tops = self.names, [], [], []
        for _, token, record in scores:
            logprob, ids, values = read_score(record, top)
            tokens.append(names[token])
            figures.append(number(logprob))
            named: dict[str, str] = {}
            for other, value in zip(ids, values, strict=True):
                if names[other] not in named:
                    named[names[other]] = f"{names[other]}:{number(value)}"
            tops.append("null" if logprob is None else f"{{{','.join(named.values())}}}")
        offsets = ",".join([str(start) for start, _, _ in scores])
        return (
            f'{{"tokens":[{",".join(tokens)}],"token_logprobs":[{",".join(figures)}],'
            f'"top_logprobs":[{",".join(tops)}],"text_offset":[{offsets}]}}'
        )

    def chat(self, scores: list[Score], top: int) -> str:
        """Chat's {"content": [entry with its "top_logprobs", ...]}."""
        entries, content = self.entries, []
        for _, token, record in scores:
            logprob, ids, values = read_score(record, top)
            pairs = zip(ids, values, strict=True)
            alternatives = ",".join([f"{entries[other]}{number(value)}}}" for other, value in pairs])
            content.append(f'{entries[token]}{number(logprob)},"top_logprobs":[{alternatives}]}}')
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
