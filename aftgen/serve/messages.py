"""The messages between the HTTP side and the engine's process (aftgen.serve.remote), one msgspec record each.

Each kind is a record tagged by its class's name, one union each way (ToEngine, FromEngine), encoded as
MessagePack: a request's work and options cross as the dataclasses they are, a turn's events as
aftgen.serve.work's records. A message that is no kind of its union, lacks a field or holds one of another type (a
bug, or a process of another version) is refused whole, as msgspec.ValidationError naming what is wrong and where,
before anything acts on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from aftgen.serve.options import ServeOptions
from aftgen.serve.work import Event, Work

# --- from the HTTP side to the engine's process ---


class Setup(msgspec.Struct, tag=True):
    """The first message: the server's options, the mixers registered in the parent (name: [module, qualified
    name, about]) and its import path, for the child to build the same engine."""

    options: ServeOptions
    mixers: dict[str, tuple[str, str, str]]
    path: list[str]


class Submit(msgspec.Struct, tag=True):
    number: int  # what the HTTP side knows the request by: its events come back under it
    work: Work


class Cancel(msgspec.Struct, tag=True):
    number: int


class AskFigures(msgspec.Struct, tag=True):
    number: int  # the ask's own number: its answer comes back under it


class Stop(msgspec.Struct, tag=True):
    """Finish the turn and leave."""


ToEngine = Setup | Submit | Cancel | AskFigures | Stop

# --- from the engine's process to the HTTP side ---


class Ready(msgspec.Struct, tag=True):
    """The engine is built (the model loaded, its step compiled)."""


class NotStarted(msgspec.Struct, tag=True):
    reason: str  # why the engine cannot be built: the error the server exits with


class Turn(msgspec.Struct, tag=True):
    events: list[tuple[int, Event]]  # each with its request's number


class Figures(msgspec.Struct, tag=True):
    number: int  # the ask's
    figures: dict[str, Any]  # Engine.stats()


FromEngine = Ready | NotStarted | Turn | Figures


class Numbered(msgspec.Struct):
    """Any message with a number, read loosely: a submit the engine's process cannot read whole still names its
    request, which then fails rather than wait for its time to run out."""

    type: str
    number: int


def _text_of_path(value: object) -> str:
    if isinstance(value, Path):
        return str(value)
    raise NotImplementedError(f"{type(value).__name__} does not cross between the server's processes")


def _path_of_text(kind: type, value: object) -> object:
    if kind is Path and isinstance(value, str):
        return Path(value)
    raise NotImplementedError(f"{kind} does not cross between the server's processes")


ENCODER = msgspec.msgpack.Encoder(enc_hook=_text_of_path)
TO_ENGINE = msgspec.msgpack.Decoder(ToEngine, dec_hook=_path_of_text)
FROM_ENGINE = msgspec.msgpack.Decoder(FromEngine)
NUMBERED = msgspec.msgpack.Decoder(Numbered)


def encode(message: ToEngine | FromEngine) -> bytes:
    return ENCODER.encode(message)


def to_engine(data: bytes) -> ToEngine:
    """The message the HTTP side sent; msgspec.DecodeError (ValidationError among them) where it is none."""
    return TO_ENGINE.decode(data)


def from_engine(data: bytes) -> FromEngine:
    """The message the engine's process sent; msgspec.DecodeError (ValidationError among them) where it is none."""
    return FROM_ENGINE.decode(data)


def submitted_number(data: bytes) -> int | None:
    """The request's number in a submit that may not be readable whole (None: not a submit, or no number)."""
    try:
        message = NUMBERED.decode(data)
    except msgspec.DecodeError:
        return None
    return message.number if message.type == Submit.__name__ else None
