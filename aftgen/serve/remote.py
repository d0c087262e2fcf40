"""The engine in a process of its own, so that the HTTP side's Python and the engine's never wait on one lock.

In one process, the engine thread and the HTTP thread take turns on Python's lock: every small tensor
operation of a turn gives it up, and getting it back waits while the HTTP side frames and sends the tokens
of the turn before. Measured with the shipped model, the engine behind HTTP in one process made about
two-fifths fewer tokens a second than the engine alone, at one row and at 32 (docs/benchmarks.md, issue 32).

So `aftgen serve` runs the Engine in a child process (`python -m aftgen.serve.remote FD`), and the HTTP side
talks to it through `EngineProcess`, which offers what Server calls on an Engine (work.EngineClient): submit,
cancel, figures, start, stop, publish. They speak length-prefixed MessagePack over a socket pair, each message a
typed record (aftgen.serve.messages): requests' work one way, a turn's events the other way in one message. The
child ignores Ctrl-C and SIGTERM (the parent stops it) and ends when the parent does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import importlib
import itertools
import math
import operator
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from aftgen.checkpoint import TOKENIZER
from aftgen.errors import AftgenError
from aftgen.generation.controls import SamplingOptions
from aftgen.mixers import MIXERS, Kind
from aftgen.serve.messages import (
    AskFigures,
    Cancel,
    Figures,
    FromEngine,
    NotStarted,
    Ready,
    Setup,
    Stop,
    Submit,
    ToEngine,
    Turn,
    encode,
    from_engine,
    submitted_number,
    to_engine,
)
from aftgen.serve.options import ServeOptions
from aftgen.serve.work import Done, Event, Failed, Ticket, Work
from aftgen.tokenizer import Tokenizer

if TYPE_CHECKING:
    from aftgen.serve.engine import Engine

START_TIMEOUT = 600.0  # seconds for the child to load the model (a Hub download is done before) and compile
STOP_TIMEOUT = 10.0  # seconds the child gets to finish its turn and leave before it is killed
ANSWER_WITHIN = 1.0  # seconds /health waits for the child's figures: past that, it is not answering
RESTARTS_PER_MINUTE = 5  # a child that keeps dying is not restarted more often: the server exits instead
# Seconds between looks for the child's messages while requests run. A message to a reader asleep in the
# kernel makes the child wake it, which costs the child's turn several times what a message to a reader that
# looks on its own clock does (figures: docs/benchmarks.md). Idle, the reader sleeps until woken.
LOOK_EVERY = 0.0005
ENGINE_GONE = "the generation process stopped unexpectedly (see the server's log); it is being started again"
RESTARTING = "the generation process is starting again after it stopped unexpectedly; try again shortly"
NOT_KEEPING_UP = "the generation process is not keeping up with the requests sent to it; try again shortly"


def send(connection: Connection, message: ToEngine | FromEngine) -> None:
    connection.send_bytes(encode(message))


def mixers_message() -> dict[str, tuple[str, str, str]]:
    """This process's mixer registry by import path: one registered at run time is registered in the child too."""
    return {name: (kind.mixer.__module__, kind.mixer.__qualname__, kind.about) for name, kind in MIXERS.items()}


def register_mixers(entries: dict[str, tuple[str, str, str]]) -> None:
    for name, (module, qualname, about) in entries.items():
        if name not in MIXERS:
            try:
                mixer = operator.attrgetter(qualname)(importlib.import_module(module))
            except (ImportError, AttributeError):
                raise AftgenError(
                    f"the mixer '{name}' was registered in this process from {module}.{qualname}, which the engine's "
                    "process cannot import: define the class at the top level of a module"
                ) from None
            MIXERS[name] = Kind(mixer, about)


class EngineUnavailable(Exception):
    """The engine cannot answer now: its status for /health ("engine not answering", "engine restarting")."""


class Child:
    """One engine process: started with `options`, ready when built (the model loaded, its step compiled).

    What the HTTP side sends it goes through `post`, which never blocks: a writer thread of the child's own
    sends the messages in order, so a child that stops reading (stopped, or slower than its clients) fills
    `outgoing` and never the event loop's time. Submits waiting there are bounded by what the server could
    hold (`--parallel` rows and `--queue`); past that `post` refuses them.
    """

    def __init__(self, options: ServeOptions):
        self.limit = options.parallel + options.queue
        self.outgoing: deque[tuple[ToEngine, Ticket | None]] = deque()  # a submit's message comes with its ticket
        self.submits, self.closed = 0, False  # submits in `outgoing`; closed: nothing more is sent
        self.posted = threading.Condition()
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "aftgen.serve.remote", str(theirs.fileno())]
        self.began, self.started_in = time.monotonic(), 0.0  # started_in: seconds until it was ready
        self.process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.connection = Connection(ours.detach())
        send(self.connection, Setup(options, mixers_message(), sys.path))
        self.writer = threading.Thread(target=self._write, name="aftgen-engine-sends", daemon=True)

    def until_ready(self) -> None:
        """Wait for the child to build its engine; AftgenError where it cannot (it has ended then)."""
        try:
            if self.connection.poll(START_TIMEOUT):
                answer = from_engine(self.connection.recv_bytes())
            else:
                answer = NotStarted(f"the generation process did not start within {START_TIMEOUT:g} s")
        except (EOFError, OSError):
            answer = NotStarted(f"the generation process ended as it started (exit status {self.process.wait()})")
        except msgspec.DecodeError as exc:
            answer = NotStarted(f"the generation process answered its start with a message that cannot be read: {exc}")
        if not isinstance(answer, Ready):
            self.process.kill()
            self.process.wait()
            self.connection.close()
            early = f"the generation process sent {type(answer).__name__} before it was ready"
            raise AftgenError(answer.reason if isinstance(answer, NotStarted) else early)
        self.started_in = time.monotonic() - self.began
        self.writer.start()

    def post(self, message: ToEngine, ticket: Ticket | None = None) -> bool:
        """Queue `message` for the child (with its ticket for a submit); False where it cannot go: the child
        has ended, or a submit finds `limit` others still waiting to be sent."""
        with self.posted:
            if self.closed or (ticket is not None and self.submits >= self.limit):
                return False
            self.outgoing.append((message, ticket))
            self.submits += ticket is not None
            self.posted.notify()
        return True

    def _write(self) -> None:
        """Send what is posted, in order, until the child stops reading for good; a submit whose client has
        gone meanwhile is never sent."""
        while True:
            with self.posted:
                while not self.outgoing and not self.closed:
                    self.posted.wait()
                if self.closed:
                    return
                message, ticket = self.outgoing.popleft()
                self.submits -= ticket is not None
            if ticket is not None and ticket.cancelled:
                continue
            try:
                send(self.connection, message)
            except OSError:  # the child has gone: its reader sees the end
                return
            if isinstance(message, Stop):
                return

    def close(self) -> list[Ticket]:
        """After the child's end: nothing more is posted, the process is reaped (no zombie), and the tickets
        whose submits were never sent are returned."""
        with self.posted:
            self.closed = True
            unsent = [ticket for _, ticket in self.outgoing if ticket is not None]
            self.outgoing.clear()
            self.posted.notify()
        try:
            self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:  # it closed its end of the socket and went on: not ours to wait for
            self.process.kill()
            self.process.wait()
        self.connection.close()
        return unsent

    def stop(self) -> None:
        """Ask the child to finish its turn and leave; kill it if it has not within STOP_TIMEOUT (at once
        while it is starting: it reads nothing until it is ready)."""
        if not self.writer.is_alive():
            self.process.kill()
            return
        with self.posted:
            self.outgoing.append((Stop(), None))
            self.posted.notify()
        try:
            self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:  # stopped (SIGSTOP) or stuck in a turn
            self.process.kill()


class EngineProcess:
    """The engine, run by a child process: what Server calls on an Engine, for `options` (the model already a
    local folder). Starting it loads the model there, and compiles its step, before it returns.

    A child that dies is reaped and started again with the same options: its streams end with an error event,
    requests meanwhile get a 503 with Retry-After (the seconds the last start took, less those since the end).
    After RESTARTS_PER_MINUTE restarts within a minute it gives up and calls `on_give_up` (aftgen serve then
    exits, for a supervisor)."""

    def __init__(self, options: ServeOptions):
        self.options = options
        self.publish: Callable[[list[tuple[Ticket, Event]]], None] = lambda events: None
        self.on_give_up: Callable[[], None] = lambda: None
        self.tickets: dict[int, Ticket] = {}  # live requests by the HTTP side's numbers, which the child knows too
        self.asked: dict[int, tuple[float, Future]] = {}  # asks for figures not answered yet: when, for whom
        self.asks = itertools.count()  # the asks' numbers, across children
        self.restarts: deque[float] = deque()  # when, over the last minute
        self.stopping, self.given_up = False, None  # given_up: why the server must exit
        self.child: Child | None = Child(options)  # None while it is started again
        self.starting = self.child
        self.child.until_ready()
        self.last_start = self.child  # the last child started: how long a start takes, for a 503's Retry-After
        self.down_since = 0.0  # when the last child ended
        self.tokenizer = Tokenizer.load(Path(options.model) / TOKENIZER)  # the child has checked the checkpoint

    def start(self) -> None:
        self._read_from(self.child)

    def stop(self) -> None:
        self.stopping = True
        for child in {self.child, self.starting} - {None}:
            child.stop()

    def submit(self, work: Work, number: int = 0) -> Ticket:
        """Queue a request the HTTP side knows by `number` (a full server answers it with a 503 event)."""
        ticket = Ticket(work, time.monotonic() + self.options.timeout, number)
        if type(work.options) is not SamplingOptions:  # a control added at run time: the child knows only its own
            message = f"the engine's process cannot take this request's options ({type(work.options).__name__})"
            self.publish([(ticket, Failed(500, f"{message}: serve this model with an engine in this process"))])
            return ticket
        self.tickets[number] = ticket
        child = self.child
        if (child is None or not child.post(Submit(number, work), ticket)) and (
            self.tickets.pop(number, None) is not None  # else the child's end has failed it already
        ):
            self.publish([(ticket, self._refusal(child))])
        return ticket

    def _refusal(self, child: Child | None) -> Failed:
        if child is None or child.closed:
            left = self.last_start.started_in - (time.monotonic() - self.down_since)
            return Failed(503, RESTARTING, code="engine_restarting", retry_after=max(1, math.ceil(left)))
        return Failed(503, NOT_KEEPING_UP, code="server_overloaded")

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: the child drops its work, and its late events are dropped here."""
        ticket.cancelled = True
        if self.tickets.pop(ticket.number, None) is not None and (child := self.child) is not None:
            child.post(Cancel(ticket.number))

    async def figures(self) -> dict:
        """The child's figures, within ANSWER_WITHIN seconds; EngineUnavailable where it cannot give them.

        Each ask has a number and its answer goes to that ask alone: one that comes late is dropped. While an
        ask stays unanswered past ANSWER_WITHIN, the engine is not answering and no more asks pile up."""
        child, now = self.child, time.monotonic()
        if child is None:
            raise EngineUnavailable("engine restarting")
        if any(now - asked_at > ANSWER_WITHIN for asked_at, _ in list(self.asked.values())):
            raise EngineUnavailable("engine not answering")
        number, answer = next(self.asks), Future()
        self.asked[number] = (now, answer)
        if not child.post(AskFigures(number)):
            self.asked.pop(number, None)
            raise EngineUnavailable("engine restarting")
        try:  # shielded: a wait that times out leaves the answer to the reader thread, which drops it
            figures = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(answer)), ANSWER_WITHIN)
        except TimeoutError:
            raise EngineUnavailable("engine not answering") from None
        if figures is None:  # the child ended meanwhile
            raise EngineUnavailable("engine restarting")
        return figures

    def _read_from(self, child: Child) -> None:
        threading.Thread(target=self._read, args=(child,), name="aftgen-engine-events", daemon=True).start()

    def _read(self, child: Child) -> None:
        """The child's messages, until it ends: a turn's events to `publish`, figures to their asks. One that
        cannot be read is left with one line on stderr (its requests end at their --timeout)."""
        connection = child.connection
        while True:
            try:
                while self.tickets and not connection.poll(0):
                    time.sleep(LOOK_EVERY)
                message = from_engine(connection.recv_bytes())
            except (EOFError, OSError):
                break
            except msgspec.DecodeError as exc:
                print(f"aftgen serve: a message from the generation process cannot be read: {exc}", file=sys.stderr)
                continue
            if isinstance(message, Figures):
                if (asked := self.asked.pop(message.number, None)) is not None:
                    asked[1].set_result(message.figures)
            elif isinstance(message, Turn):
                self.publish(self._delivered(message.events))
        self._ended(child)

    def _delivered(self, events: list[tuple[int, Event]]) -> list[tuple[Ticket, Event]]:
        """A turn's events with their live tickets (the others: cancelled, or answered twice), which they end."""
        delivered = []
        for number, event in events:
            ended = isinstance(event, Done | Failed)
            ticket = self.tickets.pop(number, None) if ended else self.tickets.get(number)
            if ticket is not None:
                delivered.append((ticket, event))
        return delivered

    def _ended(self, child: Child) -> None:
        """The child has ended: reap it and, unless the server is stopping (its connections end with it), fail
        what it held and start another."""
        self.child, self.down_since = None, time.monotonic()
        unsent = set(child.close())
        if self.stopping:
            return
        print(f"aftgen serve: the generation process ended (exit status {child.process.returncode}); starting it "
              "again", file=sys.stderr, flush=True)  # fmt: skip
        for asked in [self.asked.pop(number, None) for number in list(self.asked)]:
            if asked is not None:
                asked[1].set_result(None)
        held = [ticket for number in list(self.tickets) if (ticket := self.tickets.pop(number, None))]
        # a request never sent is refused as one that came now; one the child held fails as a stream cut short
        self.publish(
            [(ticket, self._refusal(None) if ticket in unsent else Failed(500, ENGINE_GONE)) for ticket in held]
        )
        self._restart()

    def _restart(self) -> None:
        """Start a child again, up to RESTARTS_PER_MINUTE times a minute; past that, give up."""
        while not self.stopping:
            now = time.monotonic()
            while self.restarts and now - self.restarts[0] > 60:
                self.restarts.popleft()
            if len(self.restarts) >= RESTARTS_PER_MINUTE:
                self.given_up = (
                    f"the generation process ended {len(self.restarts) + 1} times within a minute; the server "
                    "stops so that whatever supervises it can start it again (see the log above for why)"
                )
                self.on_give_up()
                return
            self.restarts.append(now)
            try:
                self.starting = child = Child(self.options)
                child.until_ready()
            except (AftgenError, OSError) as exc:  # OSError: no process could be made (out of memory, of PIDs)
                print(f"aftgen serve: {exc}", file=sys.stderr, flush=True)
                continue
            if self.stopping:  # stop() came while it started
                child.stop()
                return
            self.child = self.last_start = child
            self._read_from(child)
            print("aftgen serve: the generation process is serving again", file=sys.stderr, flush=True)
            return


def _child(connection: Connection) -> None:
    """The child's side: build the engine, then answer the parent's messages until told to stop."""
    # Ctrl-C and a stop's SIGTERM reach the whole group: the parent stops this one (a child that died of them
    # would be started again, as one that died of anything else, while the server shuts down)
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    try:
        given = to_engine(connection.recv_bytes())
        if not isinstance(given, Setup):
            raise AftgenError(f"the generation process was sent {given} before its setup")
        sys.path[:0] = [folder for folder in given.path if folder not in sys.path]
        register_mixers(given.mixers)
        engine = build_engine(given.options)
    except (AftgenError, msgspec.DecodeError) as exc:
        send(connection, NotStarted(str(exc)))
        return
    sending = threading.Lock()  # the engine's thread sends events, this one answers asks for figures

    def publish(events: list[tuple[Ticket, Event]]) -> None:
        message = Turn([(ticket.number, event) for ticket, event in events])
        with sending:
            send(connection, message)

    engine.publish = publish
    with loaded_kept():
        send(connection, Ready())
        engine.start()
        _answer(connection, engine, sending)
        engine.stop()


@contextlib.contextmanager
def loaded_kept() -> Iterator[None]:
    """While serving, what is loaded so far is left out of the garbage collector's full collections (one
    scans every loaded object, a pause in which every stream waits); it is handed back at the end, for
    the exit to free (nanobind reports what is left)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _answer(connection: Connection, engine: Engine, sending: threading.Lock) -> None:
    """Do what the parent asks, until it says stop or goes away."""
    # The requests the engine still holds, by the parent's numbers: gone once it drops them.
    tickets: weakref.WeakValueDictionary[int, Ticket] = weakref.WeakValueDictionary()
    while True:
        try:
            data = connection.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            message = to_engine(data)
        except msgspec.DecodeError as exc:
            _refuse(engine, data, exc)
            continue
        if isinstance(message, Stop):
            return
        if isinstance(message, Submit):
            tickets[message.number] = engine.submit(message.work, message.number)
        elif isinstance(message, Cancel) and (ticket := tickets.get(message.number)) is not None:
            engine.cancel(ticket)
        elif isinstance(message, AskFigures):
            with sending:
                send(connection, Figures(message.number, engine.stats()))


def _refuse(engine: Engine, data: bytes, error: msgspec.DecodeError) -> None:
    """A message that cannot be read (a bug, or a parent of another version): one line on stderr, and a submit's
    request, where it can be named, fails at once; the engine goes on."""
    print(f"aftgen serve: the generation process cannot read a message sent to it: {error}", file=sys.stderr)
    if (number := submitted_number(data)) is not None:
        failed = Failed(500, f"the generation process cannot read this request: {error}")
        engine.publish([(Ticket(Work([], SamplingOptions()), 0.0, number), failed)])


def build_engine(options: ServeOptions) -> Engine:
    """The engine `aftgen serve` runs for `options`: the model loaded, its step compiled (aftgen.serve.batch)."""
    from aftgen import cores
    from aftgen.api import load
    from aftgen.device import resolve
    from aftgen.layers import batch_invariant
    from aftgen.mixers import fixed_size_state
    from aftgen.serve.batch import CompiledBatchStep
    from aftgen.serve.engine import Engine
    from aftgen.serve.options import HTTP_CORES

    cores.set_up("serve", options.threads, HTTP_CORES, busy=False)
    where = resolve(options.device, options.dtype, generating=True)
    model, tokenizer = load(options.model, where.device)
    if not fixed_size_state(model.config.mixer):
        raise AftgenError(
            f"aftgen serve batches fixed-size states; a {model.config.mixer} model's state grows with its stream"
        )
    model.eval().lower_weights(where.weights)
    invariance = batch_invariant(options.batch_invariant, where.device, options.compile_step)
    options = dataclasses.replace(options, batch_invariant=invariance.on)
    step = None
    if options.compile_step:  # its batch_invariant and batch_invariant_reason: the decision, once timed
        step = CompiledBatchStep(model, options.parallel, where, invariance=invariance)
    return Engine(model, tokenizer, options, where, step)


if __name__ == "__main__":
    _child(Connection(int(sys.argv[1])))
