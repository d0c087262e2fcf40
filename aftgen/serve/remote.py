"""The engine in a process of its own, so that the HTTP side's Python and the engine's never wait on one lock.

In one process, the engine thread and the HTTP thread take turns on Python's lock: every small tensor
operation of a turn gives it up, and getting it back waits while the HTTP side frames and sends the tokens
of the turn before. Measured with the shipped model on 2 cores, the engine alone made 13,900 tokens/s at 32
rows and 1,600 at one; behind HTTP in one process, 8,300 and 990 (docs/benchmarks.md, issue 32).

So `aftgen serve` runs the Engine in a child process (`python -m aftgen.serve.remote FD`), and the HTTP side
talks to it through `EngineProcess`, which offers what Server calls on an Engine: submit, cancel, stats, start,
stop, publish. They speak length-prefixed JSON over a socket pair: requests' work one way, a turn's events
the other way in one message. The child ignores Ctrl-C (the parent stops it) and ends when the parent does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import itertools
import json
import operator
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aftgen.checkpoint import TOKENIZER
from aftgen.errors import AftgenError
from aftgen.mixers import MIXERS, Kind
from aftgen.sampling import SamplingOptions
from aftgen.serve.options import ServeOptions
from aftgen.serve.work import Done, Event, Failed, Finished, Started, Text, Ticket, Work
from aftgen.tokenizer import Tokenizer

if TYPE_CHECKING:
    from aftgen.serve.engine import Engine

EVENTS = {kind.__name__: kind for kind in (Started, Text, Finished, Failed, Done)}
START_TIMEOUT = 600.0  # seconds for the child to load the model (a Hub download is done before) and compile
STOP_TIMEOUT = 10.0  # seconds the child gets to finish its turn and leave before it is killed
STATS_TIMEOUT = 5.0  # seconds /health waits for the child's figures
# Seconds between looks for the child's messages while requests run. A message to a reader asleep in the
# kernel makes the child wake it (about 20 us of the child's time on a 2-core VM, 66 us a message seen in
# the engine's turn); to a reader that looks on its own clock, 4 us. Idle, the reader sleeps until woken.
LOOK_EVERY = 0.0005
ENGINE_GONE = "the generation process stopped unexpectedly (see the server's log); restart the server"


def send(connection: Connection, message: Any) -> None:
    connection.send_bytes(json.dumps(message, separators=(",", ":")).encode())


def receive(connection: Connection) -> Any:
    return json.loads(connection.recv_bytes())


def options_message(options: ServeOptions) -> dict:
    return {name: str(value) if isinstance(value, Path) else value for name, value in vars(options).items()}


def options_from_message(fields: dict) -> ServeOptions:
    options = ServeOptions(**fields)
    if options.sessions_dir is not None:
        options.sessions_dir = Path(options.sessions_dir)
    return options


def mixers_message() -> dict:
    """This process's mixer registry by import path: one registered at run time is registered in the child too."""
    return {name: [kind.mixer.__module__, kind.mixer.__qualname__, kind.about] for name, kind in MIXERS.items()}


def register_mixers(entries: dict) -> None:
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


def work_message(work: Work) -> dict:
    return dataclasses.asdict(work)


def work_from_message(fields: dict) -> Work:
    options = SamplingOptions(**fields.pop("options"))
    options.stop = tuple(options.stop)
    return Work(options=options, **fields)


def event_message(event: Event) -> list:
    return [type(event).__name__, *vars(event).values()]


def event_from_message(fields: list) -> Event:
    return EVENTS[fields[0]](*fields[1:])


class EngineProcess:
    """The engine, run by a child process: what Server calls on an Engine, for `options` (the model already a
    local folder). Starting it loads the model there, and compiles its step, before it returns."""

    def __init__(self, options: ServeOptions):
        self.options = options
        self.publish: Callable[[list[tuple[Ticket, Event]]], None] = lambda events: None
        self.tickets: dict[int, Ticket] = {}  # live requests by the number the child knows them by
        self.numbers = itertools.count()
        self.replies: queue.Queue = queue.Queue()  # the child's answers to `stats`
        self.sending, self.gone, self.stopping = threading.Lock(), False, False
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "aftgen.serve.remote", str(theirs.fileno())]
        self.process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.connection = Connection(ours.detach())
        send(self.connection, {"options": options_message(options), "mixers": mixers_message(), "path": sys.path})
        self._until_ready()
        self.tokenizer = Tokenizer.load(Path(options.model) / TOKENIZER)  # the child has checked the checkpoint
        self.reader = threading.Thread(target=self._read, name="aftgen-engine-events", daemon=True)

    def _until_ready(self) -> None:
        try:
            if not self.connection.poll(START_TIMEOUT):
                self.process.kill()
                raise AftgenError(f"the generation process did not start within {START_TIMEOUT:g} s")
            kind, detail = receive(self.connection)
        except (EOFError, OSError):
            kind, detail = "failed", f"the generation process ended as it started (exit status {self.process.wait()})"
        if kind == "failed":
            self.process.wait()
            self.connection.close()
            raise AftgenError(detail)

    def start(self) -> None:
        self.reader.start()

    def stop(self) -> None:
        self.stopping = True
        self._send(["stop"])
        try:
            self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.connection.close()

    def submit(self, work: Work, inbox: object = None) -> Ticket:
        """Queue a request whose events go to `inbox` (a full server answers it with a 503 event)."""
        ticket = Ticket(work, time.monotonic() + self.options.timeout, inbox, number=next(self.numbers))
        self.tickets[ticket.number] = ticket
        if not self._send(["submit", ticket.number, work_message(work)]):
            del self.tickets[ticket.number]
            self.publish([(ticket, Failed(500, ENGINE_GONE))])
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        ticket.cancelled = True
        self._send(["cancel", ticket.number])

    def stats(self) -> dict:
        if not self._send(["stats"]):
            return {"engine": "stopped"}
        try:
            return self.replies.get(timeout=STATS_TIMEOUT)
        except queue.Empty:
            return {"engine": "not answering"}

    def _send(self, message: list) -> bool:
        """Send to the child; False where it has gone."""
        with self.sending:
            if self.gone:
                return False
            try:
                send(self.connection, message)
            except OSError:
                return False
        return True

    def _read(self) -> None:
        """The child's messages, until it ends: a turn's events to `publish`, answers to `stats`."""
        while True:
            try:
                while self.tickets and not self.connection.poll(0):
                    time.sleep(LOOK_EVERY)
                kind, detail = receive(self.connection)
            except (EOFError, OSError):
                break
            if kind == "stats":
                self.replies.put(detail)
                continue
            events = []
            for number, *fields in detail:
                event = event_from_message(fields)
                ended = isinstance(event, Done | Failed)
                ticket = self.tickets.pop(number, None) if ended else self.tickets.get(number)
                if ticket is not None:  # None: a request the child answered twice (an error after its end)
                    events.append((ticket, event))
            self.publish(events)
        self._engine_gone()

    def _engine_gone(self) -> None:
        """Every live request fails; later ones fail at once (the server goes on answering, and says so)."""
        with self.sending:
            self.gone = True
        self.replies.put({"engine": "stopped"})
        if not self.stopping:
            print(f"aftgen serve: {ENGINE_GONE}", file=sys.stderr, flush=True)
        tickets, self.tickets = list(self.tickets.values()), {}
        self.publish([(ticket, Failed(500, ENGINE_GONE)) for ticket in tickets])


def _child(connection: Connection) -> None:
    """The child's side: build the engine, then answer the parent's messages until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops this one
    given = receive(connection)
    sys.path[:0] = [folder for folder in given["path"] if folder not in sys.path]
    try:
        register_mixers(given["mixers"])
        engine = build_engine(options_from_message(given["options"]))
    except AftgenError as exc:
        send(connection, ["failed", str(exc)])
        return
    sending = threading.Lock()  # the engine's thread sends events, this one answers `stats`

    def publish(events: list[tuple[Ticket, Event]]) -> None:
        message = ["events", [[ticket.inbox, *event_message(event)] for ticket, event in events]]
        with sending:
            send(connection, message)

    engine.publish = publish
    with loaded_kept():
        send(connection, ["ready", None])
        engine.start()
        _answer(connection, engine, sending)
        engine.stop()


@contextlib.contextmanager
def loaded_kept() -> Iterator[None]:
    """While serving, what is loaded so far is left out of the garbage collector's full collections (one
    scans about 300,000 objects: 100 ms in which every stream waits); it is handed back at the end, for
    the exit to free (nanobind reports what is left)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _answer(connection: Connection, engine: Engine, sending: threading.Lock) -> None:
    """Do what the parent asks, until it says stop or goes away."""
    # The requests the engine still holds, by the parent's numbers (each ticket's inbox): gone once it drops them.
    tickets: weakref.WeakValueDictionary[int, Ticket] = weakref.WeakValueDictionary()
    while True:
        try:
            kind, *detail = receive(connection)
        except (EOFError, OSError):  # the parent is gone
            return
        if kind == "stop":
            return
        if kind == "submit":
            number, fields = detail
            try:
                work = work_from_message(fields)
            except TypeError as exc:  # options this process does not know (a control added at run time)
                failed = Failed(500, f"the engine's process cannot take this request's options: {exc}")
                engine.publish([(Ticket(Work([], SamplingOptions()), 0.0, number), failed)])
                continue
            tickets[number] = engine.submit(work, number)
        elif kind == "cancel" and (ticket := tickets.get(detail[0])) is not None:
            engine.cancel(ticket)
        elif kind == "stats":
            with sending:
                send(connection, ["stats", engine.stats()])


def build_engine(options: ServeOptions) -> Engine:
    """The engine `aftgen serve` runs for `options`: the model loaded, its step compiled (aftgen.serve.batch)."""
    from aftgen import cores
    from aftgen.api import load
    from aftgen.device import resolve
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
    step = CompiledBatchStep(model, options.parallel, where) if options.compile_step else None
    return Engine(model, tokenizer, options, where, step)


if __name__ == "__main__":
    _child(Connection(int(sys.argv[1])))
