"""Continuous batching: every generating sequence advances by one batched recurrent step per token.

The engine runs in one thread of its own. Each turn of its loop it takes new requests in (as rows
free up), reads about `prompt_chunk` prompt tokens in the parallel form (so a long prompt is read
in pieces between steps instead of stalling everyone), then steps the whole batch once and hands
each sequence its token. A finished, cancelled (client gone) or timed-out sequence leaves the batch
in the same turn, and its row is free for the next request.

A request's constraint (structured output) is its own business: it is compiled on a thread of its own
before the request queues (constraining.py), a constraint that breaks fails its request alone, and a row's masks
may take as long as the batch's steps (rows.MASK_SHARE, past rows.MASK_GRACE) before its request is ended.
Where a prompt starts reading and what it leaves in the prefix cache is prompts.py's; a session's file is written
by session_writer.py.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

import torch

from aftgen import cores
from aftgen.compiled.availability import with_fallbacks
from aftgen.constraints import ConstraintBroken
from aftgen.device import Placement
from aftgen.generation.drawing import ScoresNotFinite, new_generator
from aftgen.generation.scores import token_scores
from aftgen.generation.stream import TextStream, next_tokens
from aftgen.model import AFTLM, StepFunction
from aftgen.native import library
from aftgen.serve.batch import EAGER, Batch, CompiledBatchStep, eager_step
from aftgen.serve.cache import PrefixCache, state_bytes
from aftgen.serve.constraining import ConstraintCompiler
from aftgen.serve.options import ServeOptions
from aftgen.serve.prompts import Prompts
from aftgen.serve.rows import Reader, Row, broken, not_finite, over_budget, too_costly
from aftgen.serve.session_writer import SessionWriter
from aftgen.serve.sessions import SessionStore
from aftgen.serve.work import (
    Done,
    Event,
    Failed,
    Finished,
    Started,
    Text,
    Ticket,
    Work,
    merged_texts,
    timed_out,
)
from aftgen.tokenizer import Tokenizer

OVERLOADED = "every generation slot is taken and the queue is full; try again shortly"
# Seconds a turn's text may wait to go out with the next turns' text: each hand-over wakes the HTTP side, which
# costs the engine a noticeable share of a small model's step at one row. Shorter than a turn with many rows,
# so a busy server's token gaps stay one turn each (a longer wait made them alternate between one turn and two,
# widening the inter-token latency's tail; figures: docs/benchmarks.md).
TEXT_EVERY = 0.001


class Engine:
    """The model's side of the server: requests in through `submit`, their events out through `publish`."""

    def __init__(
        self,
        model: AFTLM,
        tokenizer: Tokenizer,
        options: ServeOptions,
        placement: Placement,
        step: StepFunction | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`step`: how the batch is stepped (batch.CompiledBatchStep; None: batch.eager_step). `clock`: seconds, for
        deadlines and the text's hand-over."""
        self.model, self.tokenizer, self.options, self.placement = model, tokenizer, options, placement
        if placement.device.type == "cpu":
            library.usable_library()  # built now if it must be, not in the first step that asks for scores
        step = step or eager_step(model, options.batch_invariant)
        self.batch = Batch(model, options.parallel, step)  # its rows are the Rows generating, in step order
        self.state_bytes = state_bytes(model.initial_state(1))
        self.cache = PrefixCache(options.cache_mb, options.prompt_chunk) if options.cache_mb > 0 else None
        self.sessions = SessionStore(
            model, tokenizer, options.sessions_dir, options.max_sessions, options.max_session_files
        )
        self.busy_sessions: set[str] = set()  # a turn is reading, generating or saving each
        self.prompts = Prompts(model, tokenizer, options, self.cache, self.sessions, self.busy_sessions)
        self.incoming: deque[Ticket] = deque()
        self.waiting: deque[Ticket] = deque()
        self.reading: deque[Reader] = deque()
        self.overdrawn = 0  # prompt tokens the last turn read past its budget, which this one reads less
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.session_writer = SessionWriter(self.sessions, self.wake.set)
        self.queued = 0  # submitted, not yet reading: what the queue limit counts
        self.outbox: list[tuple[Ticket, Event]] = []
        self.clock, self.sent = clock, 0.0  # sent: when events were last handed on
        self.publish: Callable[[list[tuple[Ticket, Event]]], None] = lambda events: None
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.compiler = ConstraintCompiler(tokenizer, self._enqueue, self._refuse)
        self.compiled = step if isinstance(step, CompiledBatchStep) else None  # None: a step ready at once
        if self.compiled is not None:
            self.compiled.on_ready = self.wake.set  # requests may be waiting for it

    # --- the HTTP side's calls (any thread) ---

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="aftgen-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.compiler.stop()
        if self.thread is not None:
            self.thread.join()
        self.session_writer.stop()

    def submit(self, work: Work, number: int = 0) -> Ticket:
        """Queue a request the HTTP side knows by `number` (work.EngineClient). When every row is taken and the
        queue is full, its one event is a 503. A constraint is compiled first, on the compiler's thread."""
        ticket = Ticket(work, self.clock() + self.options.timeout, number)
        with self.lock:
            full = self.queued >= self.options.queue + max(0, self.options.parallel - self.occupied())
            if not full:
                self.queued += 1
        if full:
            self.publish([(ticket, Failed(503, OVERLOADED, code="server_overloaded"))])
        elif work.options.constraint is not None:
            self.compiler.submit(ticket)
        else:
            self._enqueue(ticket)
        return ticket

    def _enqueue(self, ticket: Ticket) -> None:
        with self.lock:
            self.incoming.append(ticket)
        self.wake.set()

    def _refuse(self, ticket: Ticket, failed: Failed) -> None:
        """(The compiler's thread.) A request whose constraint did not compile leaves the queue with its error."""
        self._dequeued()
        self.publish([(ticket, failed)])

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: stop its work and free its rows at the next turn (a no-op once it is done)."""
        ticket.cancelled = True
        self.wake.set()

    def occupied(self) -> int:
        """Rows generating or promised to requests reading their prompts."""
        return len(self.batch) + sum(reader.ticket.work.n for reader in list(self.reading))

    async def figures(self) -> dict:
        """stats(), as the HTTP side asks an engine in another process for them (remote.EngineProcess.figures)."""
        return self.stats()

    def stats(self) -> dict:
        return {
            "slots_total": self.options.parallel,
            "slots_busy": self.occupied(),
            "queued": self.queued,
            "cache_entries": len(self.cache) if self.cache else 0,
            "cache_mb": round(self.cache.size / 1e6, 3) if self.cache else 0.0,
            "sessions_in_memory": len(self.sessions),
            "session_files": len(self.sessions.on_disk),
            "state_bytes": self.state_bytes,
            "threads": torch.get_num_threads(),
        } | with_fallbacks(self.step_figures())

    def step_figures(self) -> dict:
        """Which step serves (batch.COMPILING while it is not ready), whether it is batch-invariant, and why it is
        eager where it is."""
        if self.compiled is not None:
            return self.compiled.figures()
        return {"step": EAGER, "batch_invariant": bool(self.options.batch_invariant), "step_note": "--no-compile"}

    def ready(self) -> bool:
        """The step that serves is settled: until then requests wait, so no text comes from another step."""
        return self.compiled is None or self.compiled.ready.is_set()

    # --- the engine thread ---

    def _run(self) -> None:
        with self.placement.autocast():
            while not self.stopping:
                if not self._has_work():
                    self._sleep()
                try:
                    self.turn()
                except Exception:  # a bug must not take the server down: fail what is running, go on
                    traceback.print_exc(file=sys.stderr)
                    self._fail_everything()
                    self._flush(at_once=True)

    def _has_work(self) -> bool:
        saved = self.session_writer.any_written()
        return bool(self.batch.rows or self.reading or self.incoming or saved or self._admissible())

    def _admissible(self) -> bool:
        """Some request waiting could be taken in: none before the step is ready, nor one whose session's last
        turn is being saved (the step's compile and each save wake the loop when they end)."""
        saving = self.session_writer.sessions_saving()
        return self.ready() and any(ticket.work.session not in saving for ticket in self.waiting)

    def _sleep(self) -> None:
        """Nothing to do: sleep until work comes (submit, cancel and stop wake the loop), text waiting here is
        due, or the process is to give its cores back. An idle server wakes for nothing else: each wake finds the
        caches gone cold and costs CPU, so even waking twice a second kept a core measurably busy."""
        due = [self.sent + TEXT_EVERY - self.clock()] if self.outbox else []
        if self.waiting:  # requests waiting for the step: their deadlines are kept meanwhile
            due.append(min(ticket.deadline for ticket in self.waiting) - self.clock())
        if (give_back := cores.idle_for()) is not None:
            due.append(give_back)
        self.wake.wait(min(due, default=None))

    @torch.inference_mode()
    def turn(self) -> None:
        """One turn of the loop: take requests in, read prompt chunks, step the batch, publish the events.

        The engine's thread runs it over and over, asleep while there is nothing to do (tests drive it by hand,
        without the thread).
        """
        self.wake.clear()
        with self.lock:
            self.waiting.extend(self.incoming)
            self.incoming.clear()
        self._drop_stopped()
        self._saved()
        self._admit()
        self._read()
        self._step()
        self._flush()
        cores.adapt(busy=bool(self.batch.rows or self.reading or self.waiting))

    def _emit(self, ticket: Ticket, event: Event) -> None:
        self.outbox.append((ticket, event))

    def _flush(self, at_once: bool = False) -> None:
        """Hand the events on: a start, an end or an error at once, text every TEXT_EVERY seconds at most (each
        batch of events wakes the HTTP side). Text waiting here belongs to rows still generating, so the
        turns go on and send it."""
        if not self.outbox:
            return
        now = self.clock()
        if at_once or now >= self.sent + TEXT_EVERY or not all(isinstance(event, Text) for _, event in self.outbox):
            events, self.outbox, self.sent = merged_texts(self.outbox), [], now
            self.publish(events)

    def _dequeued(self, count: int = 1) -> None:
        with self.lock:
            self.queued -= count

    def _fail_everything(self) -> None:
        tickets = {row.ticket for row in self.batch.rows} | {reader.ticket for reader in self.reading}
        waiting = list(self.waiting)
        self._dequeued(len(waiting))
        for ticket in tickets | set(waiting):
            self._emit(ticket, Failed(500, "internal error in the generation loop (see the server's log)"))
        self.batch.clear()
        self.reading.clear()
        self.waiting.clear()
        self.busy_sessions.clear()

    def _drop_stopped(self) -> None:
        """Requests whose client left or whose time ran out give up their place, row or queue slot."""
        now = self.clock()

        def stopped(ticket: Ticket) -> bool:
            if ticket.deadline < now and not ticket.cancelled:
                self._emit(ticket, timed_out(self.options.timeout))
                ticket.cancelled = True
            return ticket.cancelled

        gone = [ticket for ticket in self.waiting if stopped(ticket)]
        if gone:
            self.waiting = deque(ticket for ticket in self.waiting if not ticket.cancelled)
            self._dequeued(len(gone))
        for reader in [reader for reader in self.reading if stopped(reader.ticket)]:
            self.reading.remove(reader)
            self.busy_sessions.discard(reader.ticket.work.session)
        self._finish([row for row in self.batch.rows if stopped(row.ticket)])

    def _admit(self) -> None:
        """Start reading the prompts of queued requests, first come first served, while rows are free (once the
        step is ready). One for a session whose last turn is being saved keeps its place until that turn's file is
        written, then reads what it wrote: its client may have left before that turn's end, and goes on."""
        if not self.ready():
            return
        saving, deferred = self.session_writer.sessions_saving(), []
        while self.waiting and self.occupied() + self.waiting[0].work.n <= self.options.parallel:
            ticket = self.waiting.popleft()
            if ticket.work.session in saving:
                deferred.append(ticket)
                continue
            self._dequeued()
            reader = self.prompts.start(ticket)
            if isinstance(reader, Failed):
                self._emit(ticket, reader)
            else:
                self.reading.append(reader)
        self.waiting.extendleft(reversed(deferred))

    def _read(self) -> None:
        """Read prompt_chunk prompt tokens, from the longest-waiting readers first, in whole pieces.

        A prompt is read in the pieces it is read in alone (PROMPT_CHUNK's comment says why), so the last piece of
        a turn may end past its budget (by less than a piece, when one prompt's last, shorter piece left less
        than the next one's): the next turn reads that much less. One reader alone is read a piece a turn, and
        prompts are read prompt_chunk tokens a turn on average, and no turn reads twice that.
        """
        budget = self.options.prompt_chunk - self.overdrawn
        while self.reading and budget > 0:
            reader = self.reading[0]
            try:
                budget -= reader.prompt.read(budget)
            except Exception:  # this request's own work: it fails alone, and the batch goes on
                traceback.print_exc(file=sys.stderr)
                self.reading.popleft()
                self._fail(reader.ticket, Failed(500, "internal error reading the prompt (see the server's log)"))
                continue
            if reader.prompt.done:
                self.reading.popleft()
                self._begin(reader)
        self.overdrawn = max(0, -budget)

    def _begin(self, reader: Reader) -> None:
        """The prompt is read: keep it in the cache, then start each choice generating."""
        ticket, work, ids = reader.ticket, reader.ticket.work, reader.prompt.ids
        self._emit(ticket, Started(len(ids), reader.cached))
        context = reader.prompt.finish()
        contexts = [context]
        if work.session is None:
            self.prompts.keep(reader.prompt, reader.cached)
            seed = work.options.seed  # choice i draws from seed + i
            contexts += [context.fork(new_generator(None if seed is None else seed + i)) for i in range(1, work.n)]
        ticket.unfinished = len(contexts)
        remember = work.reply_suffix is not None and work.session is None
        echo = self.prompts.echo(reader) if work.echo else None
        if echo:
            self._emit(ticket, echo)
        joining = []
        for index, context in enumerate(contexts):
            stream = TextStream(self.tokenizer, context, work.options, ticket.constraint)
            row = Row(ticket, index, stream, ids if remember else [], echoed=len(echo.text) if echo else 0)
            self._text(row, stream.begin())
            if stream.done:  # max_tokens 0: only the prompt was wanted
                self._end(row)
            else:
                joining.append((row, context.state))
        self.batch.add(joining)
        for row, _ in joining:
            row.stream.context.state = []  # the batch holds it now; a session gets it back when it ends

    def _step(self) -> None:
        """One batched step: every row's next token in, every row's logits out. A row whose constraint cannot
        take its token fails its request alone."""
        tokens = self._choose()
        rows = list(self.batch.rows)  # less those whose requests failed in _choose
        if not rows:
            return
        scores = self._scores(rows, tokens)
        started = self.clock()
        logits = self.batch.step(tokens)
        took, failed = self.clock() - started, set()
        for row, token, row_logits, score in zip(rows, tokens.tolist(), logits.split(1), scores, strict=True):
            if row.ticket in failed:
                continue
            row.stepped += took
            if score is not None:  # where the token's text starts, the token, its score record
                row.held.append((row.echoed + row.stream.decoded, *score))
            try:
                self._text(row, row.stream.accept(token, row_logits))
            except ConstraintBroken as exc:
                failed.add(row.ticket)
                self._fail(row.ticket, broken(row, str(exc)))
        self._finish([row for row in rows if row.stream.done and row.ticket not in failed])

    def _scores(self, rows: list[Row], tokens: torch.Tensor) -> list[tuple | None]:
        """The drawn tokens' scores for the rows whose requests ask for them, in one pass (None for the others)."""
        wanting = [i for i, row in enumerate(rows) if row.ticket.work.logprobs is not None]
        if not wanting:
            return [None] * len(rows)
        top = max(rows[i].ticket.work.logprobs for i in wanting)
        logits = self.batch.logits  # the rows' own, as they drew from them (None: rows joined or left since)
        logits = torch.cat([row.stream.context.logits for row in rows]) if logits is None else logits
        if len(wanting) < len(rows):
            index = torch.tensor(wanting, device=logits.device)
            logits, tokens = logits[index], tokens[index]
        scores = dict(zip(wanting, token_scores(logits, tokens, top), strict=True))
        return [scores.get(i) for i in range(len(rows))]

    def _choose(self) -> torch.Tensor:
        """Every row's next token (B,), in the batch's order, drawn in one pass (each row from its own options,
        history and generator). A row whose scores are NaN or infinite, whose constraint breaks or whose masks
        ran past their budget fails its request alone: next_tokens refuses before anything is drawn, so the
        rows left then draw what they would have."""
        costly = {row.ticket: too_costly(row) for row in reversed(self.batch.rows) if over_budget(row)}
        for ticket, failure in costly.items():  # each request's first row past its budget
            self._fail(ticket, failure)
        while self.batch.rows:
            rows = list(self.batch.rows)
            try:
                return next_tokens([row.stream for row in rows], self.batch.logits)
            except ScoresNotFinite as exc:
                failures = {i: not_finite(rows[i]) for i in exc.rows}
            except ConstraintBroken as exc:
                failures = {i: broken(rows[i], message) for i, message in exc.rows.items()}
            unusable: dict[Ticket, Failed] = {}  # each request's first row that cannot draw
            for i, failure in failures.items():
                unusable.setdefault(rows[i].ticket, failure)
            for ticket, failure in unusable.items():
                self._fail(ticket, failure)
        return torch.zeros(0, dtype=torch.long)

    def _fail(self, ticket: Ticket, failure: Failed) -> None:
        """One request ends with an error, its rows out of the batch; every other goes on. Its session's
        turn worked on a copy (SessionStore.get), so the session stays as it was."""
        self._emit(ticket, failure)
        self.batch.remove([row for row in self.batch.rows if row.ticket is ticket])
        self.busy_sessions.discard(ticket.work.session)

    def _text(self, row: Row, text: str, rest: bool = False) -> None:
        """Hand on a row's text with the scores of the tokens whose text it begins (rest: every score held)."""
        row.shown += len(text)
        scores = []
        while row.held and (rest or row.held[0][0] - row.echoed < row.shown):
            scores.append(row.held.popleft())
        if text or scores:
            self._emit(row.ticket, Text(row.index, text, None if row.ticket.work.logprobs is None else scores))
            if row.prompt:
                row.parts.append(text)

    def _finish(self, rows: list[Row]) -> None:
        """Take rows out of the batch (a session's state back into its context) and close them."""
        for row in rows:
            if row.ticket.work.session is not None:
                row.stream.context.state = self.batch.state_of(row)[0]
        self.batch.remove(rows)
        for row in rows:
            self._end(row)

    def _end(self, row: Row) -> None:
        """A sequence is over: its last text, its finish, its session kept, its conversation cached.

        A session's turn worked on a copy of its context (SessionStore.get): only a turn that ran to its
        end for a client still there is kept; a cancelled or timed-out one leaves the session untouched."""
        ticket, stream, session = row.ticket, row.stream, row.ticket.work.session
        if ticket.cancelled:  # the client left or its time ran out: its turn never happened
            self.busy_sessions.discard(session)
            return
        if session is not None:
            stream.end(final=False)  # an unfinished character waits in the context for the next request
            self._keep_session(row)
            return
        self._text(row, stream.end(final=True), rest=not stream.stops.stopped)  # a stop string's tokens: none
        self._close(row)

    def _close(self, row: Row) -> None:
        """The row's finish, its conversation cached, and its request's end once every row has finished."""
        ticket, stream = row.ticket, row.stream
        self._emit(ticket, Finished(row.index, "stop" if stream.stopped else "length", stream.produced))
        if row.prompt and self.cache is not None:
            self.prompts.remember_reply(row)
        ticket.unfinished -= 1
        if ticket.unfinished == 0:
            self._emit(ticket, Done())

    def _keep_session(self, row: Row) -> None:
        """Keep a session's context after its turn, its file written by the session writer (the turn ends in
        `_saved` then); the session stays busy until then, so no turn reads it before its latest write."""
        if self.sessions.folder is None:
            self._session_saved(row, None)
            return
        self.session_writer.save(row)

    def _saved(self) -> None:
        """End the turns whose session files are written, in the order they were given to the writer."""
        for row, failed in self.session_writer.written():
            self._session_saved(row, failed)

    def _session_saved(self, row: Row, failed: Failed | None) -> None:
        name = row.ticket.work.session
        self.busy_sessions.discard(name)
        if failed is not None:
            self._emit(row.ticket, failed)
            return
        self.sessions.keep(name, row.stream.context, busy=self.busy_sessions)
        self._close(row)
