"""What passes between the HTTP side and the engine: a request's work, its ticket, and the events it yields.

The engine runs in its own thread; it never touches HTTP. It reports each request's progress as
events, and the HTTP side turns them into OpenAI's JSON or server-sent events.
"""

from __future__ import annotations

from dataclasses import dataclass

from aftgen.generation.controls import SamplingOptions


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


@dataclass
class Started:
    """The prompt is read and generation begins."""

    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, those the prefix cache had already read


# A token's score: where its text starts in the choice's text, its id and its score record (aftgen.generation.scores'
# read_score: its log-probability and the likeliest tokens', as many as the engine's step drew for any row).
Score = tuple[int, int, str]


@dataclass
class Text:
    index: int  # which choice
    text: str
    # with `logprobs`: the tokens whose text this text begins, as the engine's Score records, then as the HTTP side
    # shows them once delivered (aftgen.serve.replies.shown_scores)
    scores: list | None = None


@dataclass
class Echo:
    """The prompt's text, and with `logprobs` its tokens' scores (as Text's), that begins every choice: sent once
    whatever `n`, and given to each choice as its first Text once delivered (each_choice), so an echo of thousands
    of scored tokens is neither sent nor shown once a choice."""

    text: str
    scores: list | None = None


@dataclass
class Finished:
    index: int
    reason: str  # "stop" (a stop string) or "length" (max_tokens)
    tokens: int  # generated for this choice


@dataclass
class Failed:
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


@dataclass
class Done:
    """Every choice has finished."""


Event = Started | Echo | Text | Finished | Failed | Done


@dataclass(eq=False)
class Ticket:
    """A submitted request: the engine's handle on it, and where its events go (`inbox`, set by the HTTP side)."""

    work: Work
    deadline: float
    inbox: object = None
    cancelled: bool = False
    unfinished: int = 0  # choices still generating
    number: int = 0  # what an engine in another process knows it by (aftgen.serve.remote)
    constraint: object = None  # work.options.constraint compiled (aftgen.constraints.compiled), before admission


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
