"""Requests' constraints (structured output) compiled on a thread of their own, before each request queues: a
large schema's compile holds no turn of the engine, and a constraint that cannot be followed fails its own request
(a 400 naming its field)."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from aftgen.constraints import compiled
from aftgen.errors import AftgenError
from aftgen.serve.work import Failed, Ticket
from aftgen.tokenizer import Tokenizer


class ConstraintCompiler:
    """Compiles a ticket's constraint for `tokenizer`, then `queue`s the ticket, or `refuse`s it with its failure."""

    def __init__(self, tokenizer: Tokenizer, queue: Callable[[Ticket], None], refuse: Callable[[Ticket, Failed], None]):
        self.tokenizer, self.queue, self.refuse = tokenizer, queue, refuse
        self.thread = ThreadPoolExecutor(1, "aftgen-constraints")

    def submit(self, ticket: Ticket) -> None:
        self.thread.submit(self._compile, ticket)

    def stop(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)

    def _compile(self, ticket: Ticket) -> None:
        """(The compiler's thread.) Compile the request's constraint, then queue the request; one that cannot be
        followed is a 400 naming its field."""
        work = ticket.work
        try:
            ticket.constraint = compiled(work.options.constraint, self.tokenizer)
        except AftgenError as exc:
            message = f"'{work.constraint_field}': {exc}" if work.constraint_field else str(exc)
            failed = Failed(400, message, "invalid_request_error", "invalid_constraint", param=work.constraint_field)
            self.refuse(ticket, failed)
            return
        except Exception:  # a bug: this request fails alone
            traceback.print_exc(file=sys.stderr)
            self.refuse(ticket, Failed(500, "internal error compiling the constraint (see the server's log)"))
            return
        self.queue(ticket)
