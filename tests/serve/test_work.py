"""aftgen.serve.work: the events a request yields, how a turn's texts are merged, and the one protocol
(EngineClient) that the engine in this process and the engine's process both offer the HTTP side."""

from __future__ import annotations

import inspect

import pytest

from aftgen.generation.controls import SamplingOptions
from aftgen.serve.engine import Engine
from aftgen.serve.remote import EngineProcess
from aftgen.serve.work import EngineClient, Finished, Text, Ticket, Work, merged_texts


def test_merged_texts_joins_a_choices_texts_until_an_end_of_its_request_comes_between():
    one, two = (Ticket(Work([], SamplingOptions()), 0.0) for _ in range(2))
    events = [(one, Text(0, "a")), (two, Text(0, "x")), (one, Text(1, "b")), (one, Text(0, "c")),
              (one, Finished(0, "length", 2)), (one, Text(0, "d")), (two, Text(0, "y"))]  # fmt: skip
    assert merged_texts(events) == [
        (one, Text(0, "ac")), (two, Text(0, "xy")), (one, Text(1, "b")), (one, Finished(0, "length", 2)),
        (one, Text(0, "d")),
    ]  # fmt: skip


@pytest.mark.parametrize("engine", [Engine, EngineProcess])
def test_both_engines_offer_what_the_http_side_asks_with_its_signatures(engine):
    """The HTTP side types against EngineClient: each engine has its every method, called the same way (a request
    named by the HTTP side's number in either process)."""
    for name, member in vars(EngineClient).items():
        if inspect.isfunction(member) and not name.startswith("_"):
            assert inspect.signature(getattr(engine, name)) == inspect.signature(member), name
            assert inspect.iscoroutinefunction(getattr(engine, name)) == inspect.iscoroutinefunction(member), name
