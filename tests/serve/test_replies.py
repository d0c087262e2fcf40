"""aftgen.serve.replies: the TokenScores of a turn's events written as OpenAI's `logprobs` JSON, in Python and by
the native library alike, and a record that cannot be read failing its own request alone."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from conftest import DEVICE

from aftgen.api import load
from aftgen.generation.scores import NO_SCORES
from aftgen.native import scores_json
from aftgen.serve import replies
from aftgen.serve.replies import ScoresWriter, chat_logprobs, completions_logprobs
from aftgen.serve.work import Text, Ticket


@pytest.fixture(scope="module")
def tokenizer(tiny_run):
    return load(tiny_run, DEVICE)[1]


def f32(figures: list[float]) -> list[float]:
    return np.float32(figures).tolist()


def f32_items(alternatives: dict[str, float]) -> list[tuple[str, float]]:
    return list(zip(alternatives, f32(list(alternatives.values())), strict=True))


def records_of(logprob: float, alternatives: list[tuple[int, float]]) -> str:
    """A score record (aftgen.generation.scores.read_scores) as the engine packs it."""
    ids, values = [i for i, _ in alternatives], [v for _, v in alternatives]
    return struct.pack(f"<{1 + len(ids)}f{len(ids)}i", logprob, *values, *ids).hex()


def written(writer: ScoresWriter, chat: bool, top: int, scores: list) -> dict:
    json_of = writer.write([(chat, top, scores)])[0]
    return json.loads(chat_logprobs(json_of) if chat else completions_logprobs(json_of))


@pytest.mark.parametrize("native", [True, False])
def test_the_writer_names_a_text_once_with_its_likelier_figure_and_gives_figures_back_exactly(tokenizer, native):
    writer = ScoresWriter(tokenizer, native)
    assert (writer.native is not None) == native
    texts = [tokenizer.token_text(token) for token in range(tokenizer.vocab_size)]
    shared = [token for token in range(tokenizer.vocab_size) if texts.count(texts[token]) > 1]
    assert shared, "the tiny model's tokenizer has byte-fallback pieces whose text a whole piece has too"
    twin = next(token for token in shared if token != shared[0] and texts[token] == texts[shared[0]])
    figures = np.float32([-0.1234567, -1.5, -2.000001, -7.25]).tolist()  # float32's own figures
    alternatives = [(shared[0], figures[0]), (5, figures[1]), (twin, figures[2]), (9, figures[3])]
    scores = [(0, 5, records_of(figures[1], alternatives)), (3, 9, records_of(figures[3], alternatives[:2]))]
    completions = written(writer, False, 4, scores)
    assert completions["tokens"] == [texts[5], texts[9]] and completions["text_offset"] == [0, 3]
    assert f32(completions["token_logprobs"]) == [figures[1], figures[3]]  # 9 digits give float32 back exactly
    assert f32_items(completions["top_logprobs"][0]) == [
        (texts[shared[0]], figures[0]),
        (texts[5], figures[1]),
        (texts[9], figures[3]),
    ]
    assert f32_items(completions["top_logprobs"][1]) == [(texts[shared[0]], figures[0]), (texts[5], figures[1])]
    fewer = written(writer, False, 2, [(0, 5, records_of(figures[1], alternatives))])["top_logprobs"][0]
    assert f32_items(fewer) == [(texts[shared[0]], figures[0]), (texts[5], figures[1])]  # `top`, of more held
    chat = written(writer, True, 4, scores[:1])["content"][0]
    assert [entry["token"] for entry in chat["top_logprobs"]] == [texts[token] for token, _ in alternatives]
    assert f32([chat["logprob"]]) == [figures[1]] and chat["bytes"] == list(tokenizer.token_bytes(5))
    assert [entry["bytes"] for entry in chat["top_logprobs"]] == [
        list(tokenizer.token_bytes(t)) for t, _ in alternatives
    ]
    nothing = written(writer, False, 4, [(0, 5, NO_SCORES)])
    assert nothing["token_logprobs"] == [None] and nothing["top_logprobs"] == [None]


def test_the_librarys_writer_writes_what_python_writes_byte_for_byte(tokenizer):
    """Over records with every kind of figure (tiny, huge, whole, negative zero, infinite) and every token, chat's
    shape and completions' mixed in one call, as a turn's events are."""
    native, python = ScoresWriter(tokenizer), ScoresWriter(tokenizer, native=False)
    rng = np.random.default_rng(48)
    any_bits = lambda n: rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)  # noqa: E731
    kinds = [lambda n: -rng.exponential(3, n), lambda n: -rng.exponential(1e-6, n), lambda n: rng.normal(0, 1e30, n),
             lambda n: rng.integers(-100, 1, n), any_bits]  # fmt: skip
    asks = []
    for ask in range(200):
        held = int(rng.integers(0, 21))
        figures = np.float32(kinds[ask % len(kinds)](1 + held))
        figures[rng.random(1 + held) < 0.05] = rng.choice(np.float32([0.0, -0.0, -np.inf, 1e9, 1e-22]))
        figures[np.isnan(figures)] = -1.0  # no NaN: Python and C both write "nan", which no client reads
        scores = []
        for start in range(int(rng.integers(1, 4))):
            ids = rng.integers(0, tokenizer.vocab_size, held).tolist()
            record = (
                NO_SCORES
                if rng.random() < 0.1
                else records_of(figures[0], list(zip(ids, figures[1:].tolist(), strict=True)))
            )
            scores.append((start, int(rng.integers(0, tokenizer.vocab_size)), record))
        asks.append((bool(rng.random() < 0.5), int(rng.integers(0, min(held + 5, 20) + 1)), scores))
    assert native.write(asks) == python.write(asks)


def test_the_librarys_writer_shows_many_tokens_in_pieces_as_one(tokenizer, monkeypatch):
    """An echo's thousands of prompt tokens go through the library a piece at a time: the pieces join as one."""
    monkeypatch.setattr(scores_json, "SCORE_PIECE", 3)
    record = records_of(-0.5, [(5, -0.5), (9, -1.5)])
    asks = [
        (chat, 2, [(start, 5 + start, record) for start in range(count)]) for chat, count in [(False, 7), (True, 5)]
    ]
    assert ScoresWriter(tokenizer).write(asks) == ScoresWriter(tokenizer, native=False).write(asks)


@pytest.mark.parametrize(
    "record",
    ["00", "zz000000" * 3, records_of(-1.0, [(10**6, -2.0)]), records_of(-1.0, [(-3, -2.0)]), "0000803f 00",
     "0000803f\x00"],
)  # fmt: skip
def test_the_librarys_writer_refuses_a_record_it_cannot_read(tokenizer, record):
    with pytest.raises(ValueError, match="cannot read"):
        ScoresWriter(tokenizer).write([(False, 1, [(0, 5, record)])])


@pytest.mark.parametrize("native", [True, False])
def test_an_unreadable_record_fails_its_own_request_and_no_other(tokenizer, native, monkeypatch):
    monkeypatch.setattr(replies, "scores_writer", lambda tokenizer: ScoresWriter(tokenizer, native))
    good = records_of(-1.0, [(5, -1.0), (9, -2.0)])
    asked = [(False, 2), (True, 2), None, (False, 2)]
    tickets = [Ticket(None, 0.0, number) for number in range(len(asked))]
    bad_hex, bad_token = [(0, 5, "zz" + good[2:])], [(0, 5, good), (1, 5, records_of(-1.0, [(-3, -2.0)]))]
    texts = [Text(0, "a", [(0, 5, good)]), Text(0, "b", bad_hex), Text(0, "c", None), Text(0, "d", bad_token)]
    events = list(zip(tickets, texts, strict=True))
    out = replies.scores_as_json(events, tokenizer, lambda ticket: asked[ticket.number])
    assert [ticket for ticket, _ in out] == tickets
    assert json.loads(completions_logprobs(out[0][1].scores))["tokens"] == [tokenizer.token_text(5)]
    assert out[1][1] == replies.UNREADABLE and out[2][1] == events[2][1] and out[3][1] == replies.UNREADABLE
