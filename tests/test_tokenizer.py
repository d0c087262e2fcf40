"""Tokenizer: exact round trips, streaming decode, vocabulary clamping."""

from __future__ import annotations

import pytest
from conftest import make_corpus
from hypothesis import given, settings
from hypothesis import strategies as st

from aftgen.errors import AftgenError
from aftgen.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(make_corpus(20_000, seed=5), 300, log=lambda _: None)


TRICKY = ["a\u2581b", "\ue000", "\ue000\ue000s", "  two  spaces ", "tab\tand\r\nCRLF", "héllo 世界 😀", "\x00nul", ""]


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


@settings(max_examples=150, deadline=None)
@given(st.text())
def test_round_trip_any_unicode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    decoder = tokenizer.stream_decoder()
    pieces = [decoder.feed(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text  # never a broken character


@pytest.mark.parametrize("kind", ["bpe", "unigram", "char"])
def test_kinds_train(kind):
    tok = train_tokenizer(make_corpus(8000, seed=1), 300, kind, log=lambda _: None)
    assert tok.decode(tok.encode("KING: fair day!")) == "KING: fair day!"


def test_vocab_clamped_with_message():
    messages = []
    tok = train_tokenizer(make_corpus(3000), 5000, log=messages.append)
    assert tok.vocab_size < 5000
    assert "too large" in messages[0]


def test_bad_vocab_and_kind():
    with pytest.raises(AftgenError, match="at least 260"):
        train_tokenizer("abc", 10)
    with pytest.raises(AftgenError, match="unknown tokenizer type"):
        train_tokenizer("abc", 300, "wordpiece")
