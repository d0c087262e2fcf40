"""What passes between the HTTP side and the engine: a request's work, its ticket, the events it yields, and
EngineClient, what the HTTP side asks of an engine in its own process or in another.

The engine runs in its own thread; it never touches HTTP. It reports each request's progress as
events, and the HTTP side turns them into OpenAI's JSON or server-sent events. The events are msgspec records
tagged by their class's name, so that they cross to and from an engine's process as they are
(aftgen.serve.messages), checked field by field on arrival.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec

from aftgen.generation.controls import SamplingOptions

if TYPE_CHECKING:
    from aftgen.serve.options import ServeOptions
    from aftgen.tokenizer import Tokenizer


@dataclass
class Work:
    """One request as the engine runs it."""

    prompt: list[int]  # token ids to read (the engine puts BOS before a fresh prompt)
    options: SamplingOptions  # max_new_tokens, sampling, seed, stop
    n: int = 1  # continuations of the prompt (choice i draws from seed + i when seeded)
    session: str | None = None  # a named session: the prompt continues its context, which is kept after
    reply_suffix: str | None = None  # chat: keep the state after `prompt + reply + suffix` in the prefix cache
    logprobs: int | None = None  # score each token, with this many likeliest alternatives (None: no scores)
    echo: bool = False  # the prompt's text (and with `logprobs`, its tokens' scores) first in each choice (Echo)
    constraint_field: str | None = None  # the request's field that gave options.constraint: a 400 names it


class Started(msgspec.Struct, tag=True, array_like=True):
    """The prompt is read and generation begins."""

    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, those the prefix cache had already read


# A token's scores as they cross: where its text starts in the choice's text, its id and its scores record
# (aftgen.generation.scores.read_scores: its log-probability and the likeliest tokens', as many as the engine's
# step drew for any row).
TokenScores = tuple[int, int, str]


class Text(msgspec.Struct, tag=True, array_like=True):
    index: int  # which choice
    text: str
    # with `logprobs`: the tokens whose text this text begins; once delivered, the HTTP side replaces them with
    # their JSON (aftgen.serve.replies.scores_as_json)
    scores: list[TokenScores] | None = None


class Echo(msgspec.Struct, tag=True, array_like=True):
    """The prompt's text, and with `logprobs` its tokens' scores (as Text's), that begins every choice: sent once
    whatever `n`, and given to each choice as its first Text once delivered (each_choice), so an echo of thousands
    of scored tokens is neither sent nor shown once a choice."""

    text: str
    scores: list[TokenScores] | None = None


class Finished(msgspec.Struct, tag=True, array_like=True):
    index: int
    reason: str  # "stop" (a stop string) or "length" (max_tokens)
    tokens: int  # generated for this choice


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The request ends with an error (before or during generation)."""

    status: int
    message: str
    kind: str = "server_error"
    code: str | None = None
    retry_after: int = 1  # seconds, for a 503's Retry-After
    param: str | None = None  # the request's field at fault, for a 400


def timed_out(limit: float) -> Failed:
    """A request past --timeout: the engine ends it, or the HTTP side where the engine is stopped or stuck."""
    return Failed(504, f"the request took longer than this server's limit of {limit:g} s")


class Done(msgspec.Struct, tag=True, array_like=True):
    """Every choice has finished."""


Event = Started | Echo | Text | Finished | Failed | Done


@dataclass(eq=False)
class Ticket:
    """A submitted request: the engine's handle on it. `number` is what the HTTP side knows it by, in either
    process: its events go to the inbox the HTTP side keeps under that number."""

    work: Work
    deadline: float
    number: int = 0
    cancelled: bool = False
    unfinished: int = 0  # choices still generating
    constraint: object = None  # work.options.constraint compiled (aftgen.constraints.compiled), before admission


class EngineClient(Protocol):
    """What the HTTP side (aftgen.serve.app) asks of an engine: aftgen.serve.engine.Engine runs in this process,
    aftgen.serve.remote.EngineProcess in a process of its own. The engine calls `publish` (set by the HTTP side)
    from any thread with a batch of events, each with the ticket of its request."""

    options: ServeOptions
    tokenizer: Tokenizer
    publish: Callable[[list[tuple[Ticket, Event]]], None]

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def submit(self, work: Work, number: int = 0) -> Ticket:
        """Queue a request the HTTP side knows by `number`; a full server answers it with a 503 event."""

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: its work stops and its late events are dropped (a no-op once it is done)."""

    async def figures(self) -> dict:
        """The engine's figures for /health."""


def merged_texts(events: list[tuple[Ticket, Event]]) -> list[tuple[Ticket, Event]]:
    """The events, each choice's texts joined into one until an event of its request that is not text."""
    out: list[tuple[Ticket, Event]] = []
    open_text: dict[tuple[Ticket, int], int] = {}  # a choice's text that may still grow: where it is in `out`
    for ticket, event in events:
        if isinstance(event, Text):
            at = open_text.get((ticket, event.index))
            if at is not None:
                earlier = out[at][1]
                both = (earlier.scores, event.scores)
                scores = None if both == (None, None) else [score for part in both for score in part or ()]
                out[at] = (ticket, Text(event.index, earlier.text + event.text, scores))
                continue
            open_text[ticket, event.index] = len(out)
        else:
            for key in [key for key in open_text if key[0] is ticket]:
                del open_text[key]
        out.append((ticket, event))
    return out


def each_choice(events: list[tuple[Ticket, Event]]) -> list[tuple[Ticket, Event]]:
    """The events with each Echo given to every choice of its request as its first Text (one list of scores shared)."""
    out: list[tuple[Ticket, Event]] = []
    for ticket, event in events:
        if isinstance(event, Echo):
            out += [(ticket, Text(index, event.text, event.scores)) for index in range(ticket.work.n)]
        else:
            out.append((ticket, event))
    return out
