"""OpenAI's response shapes: whole completions, stream chunks and `usage`, built from the engine's events."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from aftgen.sampling import read_score
from aftgen.serve.work import Event, Finished, Score, Started, Text
from aftgen.tokenizer import Tokenizer


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

    def whole(self) -> dict:
        """The non-streaming response, every choice in index order."""
        choices = []
        for index in sorted(self.finished):
            content = "".join(self.texts.get(index, []))
            logprobs = self.logprobs(self.scores.get(index, []))
            choice = {"index": index, "logprobs": logprobs, "finish_reason": self.finished[index].reason}
            choice |= {"message": {"role": "assistant", "content": content}} if self.chat else {"text": content}
            choices.append(choice)
        return self._header(stream=False) | {"choices": choices, "usage": self.usage()}

    def chunk(
        self,
        index: int,
        text: str | None = None,
        finish: str | None = None,
        first: bool = False,
        scores: list[Score] | None = None,
    ) -> dict:
        """A stream chunk for one choice: its text (with its tokens' `scores`), its first (chat: the role) or its
        finish."""
        logprobs = self.logprobs(scores or []) if text is not None else None
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._header(stream=True) | {"choices": [choice]}

    def logprobs(self, scores: list[Score]) -> dict | None:
        """OpenAI's `logprobs` of a choice or chunk: chat's {"content": [...]}, completions' parallel lists."""
        if self.tokenizer is None:
            return None
        read = [(start, token, *read_score(record, self.top)) for start, token, record in scores]
        if self.chat:
            return {"content": [self._chat_entry(token, logprob, top) for _, token, logprob, top in read]}
        return {
            "tokens": [self.tokenizer.token_text(token) for _, token, _, _ in read],
            "token_logprobs": [logprob for _, _, logprob, _ in read],
            "top_logprobs": [None if logprob is None else self._named(top) for _, _, logprob, top in read],
            "text_offset": [start for start, _, _, _ in read],
        }

    def _named(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """{token's text: log-probability}, likeliest first; of two tokens with one text (a byte-fallback piece
        and a whole one), the likelier."""
        named: dict[str, float] = {}
        for token, logprob in top:
            named.setdefault(self.tokenizer.token_text(token), logprob)
        return named

    def _chat_entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        alternatives = [self._chat_token(other, other_logprob) for other, other_logprob in top]
        return self._chat_token(token, logprob) | {"top_logprobs": alternatives}

    def _chat_token(self, token: int, logprob: float) -> dict:
        return {
            "token": self.tokenizer.token_text(token),
            "logprob": logprob,
            "bytes": list(self.tokenizer.token_bytes(token)),
        }

    def usage_chunk(self) -> dict:
        """The last chunk when the client asked for stream_options.include_usage."""
        return self._header(stream=True) | {"choices": [], "usage": self.usage()}
