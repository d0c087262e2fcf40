"""Chunked encoding in worker processes (aftgen/corpus/encode.py) gives the ids one encode of the whole text gives."""

from __future__ import annotations

import pytest
import torch
from conftest import make_corpus
from corpus_texts import TINY, corpus_text, quiet, write_text

from aftgen.corpus import CorpusOptions, prepare_corpus
from aftgen.tokenizer import train_tokenizer


@pytest.mark.parametrize("kind", ["bpe", "unigram", "char"])
def test_chunked_multiprocess_encoding_equals_one_shot(tmp_path, kind):
    text = corpus_text(30_000)
    prepared = prepare_corpus([write_text(tmp_path / "a.txt", text)], CorpusOptions(**TINY, tokenizer_type=kind), quiet)
    cut = int(0.9 * len(text))  # one file: its last 10% is held out, as always
    assert prepared.tokenizer.model_proto == train_tokenizer(text[:cut], 300, kind, log=quiet).model_proto
    bos = prepared.tokenizer.bos_id
    assert prepared.train_ids[:].dtype == torch.uint16
    assert prepared.train_ids[:].tolist() == [bos, *prepared.tokenizer.encode(text[:cut])]
    assert prepared.held_out_ids.tolist() == [bos, *prepared.tokenizer.encode(text[cut:])]
    assert (prepared.held_out_chars, prepared.held_out_bytes) == (len(text) - cut, len(text[cut:].encode()))


def test_words_longer_than_a_piece_are_cut_and_still_decode_exactly(tmp_path):
    text = corpus_text(20_000) + "x" * 500 + "\u65e5" * 300 + make_corpus(3000, seed=2)
    path = write_text(tmp_path / "a.txt", text)
    prepared = prepare_corpus([path], CorpusOptions(**TINY, held_out=100), quiet)
    decode = prepared.tokenizer.decode
    assert decode(prepared.train_ids[1:].tolist()) + decode(prepared.held_out_ids[1:].tolist()) == text
