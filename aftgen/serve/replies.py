"""OpenAI's response shapes: whole completions, stream chunks and `usage`, built from the engine's events."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from aftgen.serve.work import Event, Finished, Started, Text


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
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    started: Started | None = None
    texts: dict[int, list[str]] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def take(self, event: Event) -> None:
        if isinstance(event, Started):
            self.started = event
        elif isinstance(event, Text):
            self.texts.setdefault(event.index, []).append(event.text)
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
            choice = {"index": index, "logprobs": None, "finish_reason": self.finished[index].reason}
            choice |= {"message": {"role": "assistant", "content": content}} if self.chat else {"text": content}
            choices.append(choice)
        return self._header(stream=False) | {"choices": choices, "usage": self.usage()}

    def chunk(self, index: int, text: str | None = None, finish: str | None = None, first: bool = False) -> dict:
        """A stream chunk for one choice: its text, its first (chat: the role) or its finish."""
        choice = {"index": index, "logprobs": None, "finish_reason": finish}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._header(stream=True) | {"choices": [choice]}

    def usage_chunk(self) -> dict:
        """The last chunk when the client asked for stream_options.include_usage."""
        return self._header(stream=True) | {"choices": [], "usage": self.usage()}
