"""The engine's sequences: a request reading its prompt (Reader), one generating in the batch (Row), and how a
row's request fails when that row cannot go on (scores not finite, a constraint broken or too costly)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from aftgen.generation.prompt import PromptReader
from aftgen.generation.stream import TextStream
from aftgen.serve.work import Failed, Ticket, TokenScores

# A constrained row's masks may take this share of the batch's step time, after MASK_GRACE seconds (the first
# masks of a large schema): then the rows beside it keep at least half their speed, and the costliest
# constraint a server can be sent (an ambiguous grammar's masks grow with its text) ends its own request.
MASK_SHARE = 1.0
MASK_GRACE = 0.25


@dataclass(eq=False)
class Reader:
    """A request reading its prompt, chunk by chunk, before it generates."""

    ticket: Ticket
    prompt: PromptReader  # the whole prompt as read into the state (BOS first unless it continues a session)
    cached: int = 0  # of its tokens, those the prefix cache had already read


@dataclass(eq=False)
class Row:
    """One sequence generating in the batch."""

    ticket: Ticket
    index: int
    stream: TextStream
    prompt: list[int] = field(default_factory=list)  # kept to cache the conversation after a chat reply
    parts: list[str] = field(default_factory=list)
    echoed: int = 0  # characters of the prompt's text echoed before the generated text
    shown: int = 0  # characters of the generated text handed on
    stepped: float = 0.0  # seconds the batch's steps took while it was in the batch (its masks' budget)
    held: deque[TokenScores] = field(default_factory=deque)  # scores of tokens whose text is not handed on yet


def not_finite(row: Row) -> Failed:
    """How a request fails when one of its rows has NaN or infinite scores: naming the row (and its session)."""
    session = row.ticket.work.session
    if session is None:
        advice = "the model served may be damaged: tell the server's operator"
    else:
        advice = f"session '{session}' stays as it was before this request; if this happens again, start a new one"
    message = f"choice {row.index}: the model's scores for the next token are NaN or infinite, so no token could be"
    return Failed(500, f"{message} drawn ({advice})", "server_error", "scores_not_finite")


def over_budget(row: Row) -> bool:
    """The row's constraint has spent more on its masks than MASK_SHARE of the batch's steps allows."""
    matcher = row.stream.matcher
    return matcher is not None and matcher.spent > MASK_GRACE + MASK_SHARE * row.stepped


def too_costly(row: Row) -> Failed:
    spent, stepped = row.stream.matcher.spent, row.stepped
    message = (
        f"choice {row.index}: the constraint's token masks took {spent:.2f} s beside {stepped:.2f} s of the model's "
        f"steps, more than this server allows (a grammar whose rules are ambiguous grows costlier with each token)"
    )
    return Failed(500, message, "server_error", "constraint_too_costly")


def broken(row: Row, message: str) -> Failed:
    """How a request fails when a row's constraint cannot go on (llguidance's limits reached)."""
    return Failed(500, f"choice {row.index}: {message}", "server_error", "constraint_broken")
