"""aftgen.serve.messages: every message between the HTTP side and the engine's process crosses as the typed record
it is, and one that is not (a bug, or a process of another version) is refused whole with a line naming what is
wrong and where."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from aftgen.constraints import Constraint
from aftgen.generation.controls import SamplingOptions
from aftgen.serve import messages
from aftgen.serve.messages import (
    AskFigures,
    Cancel,
    Figures,
    NotStarted,
    Ready,
    Setup,
    Stop,
    Submit,
    Turn,
    encode,
    from_engine,
    submitted_number,
    to_engine,
)
from aftgen.serve.options import ServeOptions
from aftgen.serve.work import Done, Echo, Failed, Finished, Started, Text, Work

OPTIONS = SamplingOptions(max_new_tokens=7, seed=3, stop=("\n", "END"), constraint=Constraint("regex", "[a-z]+"))
WORK = Work([1, 2, 3], OPTIONS, n=2, session="s", reply_suffix="\n", logprobs=2, echo=True, constraint_field="x")
EVENTS = [Started(3, 1), Echo("KING:", [(0, 5, "0000803f")]), Echo("x"), Text(1, "ab", [(0, 5, ""), (1, 6, "00")]),
          Text(0, "c"), Finished(1, "stop", 4), Failed(503, "full", "server_error", "server_overloaded", 3, "n"),
          Failed(500, "broken"), Done()]  # fmt: skip

TO_ENGINE = [
    Setup(ServeOptions(model="m", sessions_dir=Path("sessions"), parallel=4), {"aft": ("a.b", "Mixer", "x")}, ["p"]),
    Submit(7, WORK),
    Submit(8, Work([4], SamplingOptions())),
    Cancel(7),
    AskFigures(2),
    Stop(),
]
FROM_ENGINE = [Ready(), NotStarted("no model"), Turn([(7, event) for event in EVENTS]), Figures(2, {"slots": 4})]


@pytest.mark.parametrize("message", TO_ENGINE, ids=lambda message: type(message).__name__)
def test_every_message_to_the_engine_crosses_as_it_was(message):
    assert to_engine(encode(message)) == message


@pytest.mark.parametrize("message", FROM_ENGINE, ids=lambda message: type(message).__name__)
def test_every_message_from_the_engine_crosses_as_it_was(message):
    assert from_engine(encode(message)) == message


def test_nested_options_cross_as_their_own_types():
    """Not dicts and lists rebuilt by hand: the work's options, its stop strings' tuple, its constraint, a path."""
    work = to_engine(encode(Submit(7, WORK))).work
    assert type(work.options) is SamplingOptions and work.options.stop == ("\n", "END")
    assert work.options.constraint == Constraint("regex", "[a-z]+")
    setup = to_engine(encode(TO_ENGINE[0]))
    assert setup.options.sessions_dir == Path("sessions")


def raw(fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    "data, read, error",
    [
        (raw({"type": "Submit", "work": msgspec.to_builtins(WORK)}), to_engine, "missing required field `number`"),
        (raw({"type": "Cancel", "number": "7"}), to_engine, "Expected `int`, got `str` - at `$.number`"),
        (raw({"type": "Resume", "number": 7}), to_engine, "Invalid value 'Resume' - at `$.type`"),
        (raw({"type": "Turn", "events": []}), to_engine, "Invalid value 'Turn' - at `$.type`"),
        (raw(["submit", 7, {}]), to_engine, "Expected `object`, got `array`"),
        (raw({"type": "Submit", "number": 7, "work": {"prompt": "KING", "options": {}}}), to_engine,
         "Expected `array`, got `str` - at `$.work.prompt`"),
        (raw({"type": "Submit", "number": 7, "work": {"prompt": [1], "options": {"top_k": 0.5}}}), to_engine,
         "Expected `int`, got `float` - at `$.work.options.top_k`"),
        (raw({"type": "Turn", "events": [[7, ["Text", 0]]]}), from_engine,
         "Expected `array` of at least length 3, got 2 - at `$.events[0][1]`"),
        (raw({"type": "Turn", "events": [[7, ["Paused", 0]]]}), from_engine,
         "Invalid value 'Paused' - at `$.events[0][1][0]`"),
        (raw({"type": "Figures", "number": 2}), from_engine, "missing required field `figures`"),
        (b"\xc1", from_engine, "invalid"),
    ],
)  # fmt: skip
def test_a_message_of_another_version_is_refused_naming_what_is_wrong(data, read, error):
    with pytest.raises(msgspec.DecodeError, match=error.replace("[", r"\[").replace("$", r"\$")):
        read(data)


def test_a_submit_that_cannot_be_read_whole_still_names_its_request():
    assert submitted_number(raw({"type": "Submit", "number": 7, "work": {"prompt": "KING"}})) == 7
    assert submitted_number(raw({"type": "Cancel", "number": 7})) is None
    assert submitted_number(raw(["Submit", 7])) is None
    assert submitted_number(b"\xc1") is None


def test_only_what_crosses_is_encoded():
    with pytest.raises(NotImplementedError, match="does not cross"):
        messages.encode(Figures(1, {"f": object()}))
