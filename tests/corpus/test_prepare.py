"""Corpus preparation (aftgen/corpus/prepare.py): the tokenizer reads a bounded sample, a killed preparation is
continued, a second run reuses the cache, and a run on a folder records its held-out documents."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from bad_input import invoke
from corpus_texts import TINY, corpus_text, make_folder, quiet, write_text

from aftgen.corpus import CorpusOptions, prepare_corpus
from aftgen.corpus import cache as corpus_cache
from aftgen.corpus import sample as corpus_sample
from aftgen.corpus.sample import evenly
from aftgen.errors import AftgenError
from aftgen.tokenizer import TRAINER_SLICE, train_tokenizer


def test_batches_from_a_token_file_that_hands_its_pages_back(tmp_path, monkeypatch):
    from aftgen.corpus import token_file
    from aftgen.training.batches import batch

    monkeypatch.setattr(token_file, "RELEASE_ABOVE", 0)  # unmap after every batch, however small the file
    prepared = prepare_corpus([write_text(tmp_path / "a.txt", corpus_text(30_000))], CorpusOptions(**TINY), quiet)
    mapped, copy = prepared.train_ids, prepared.train_ids[:].clone()
    assert mapped.large
    for seed in range(3):
        from_file = batch(mapped, 4, 16, torch.Generator().manual_seed(seed))
        from_memory = batch(copy, 4, 16, torch.Generator().manual_seed(seed))
        assert all(torch.equal(a, b) for a, b in zip(from_file, from_memory, strict=True))


def test_sample_is_drawn_from_across_the_corpus():
    slices = [f"{index:05d}" for index in range(1000)]
    chosen = [int(piece) for piece in evenly(slices, total=5000, budget=500)]
    assert len(chosen) == 100 and chosen[0] < 10 and chosen[-1] > 990
    assert max(b - a for a, b in zip(chosen, chosen[1:], strict=False)) <= 10  # evenly spread, not the start
    assert list(evenly(slices, total=5000, budget=5000)) == slices  # all of it when it fits


def test_tokenizer_sample_is_bounded(tmp_path, monkeypatch):
    """The trainer reads about `tokenizer_sample` characters (20M unless told), not the whole text."""
    assert CorpusOptions().tokenizer_sample == 20_000_000
    text = corpus_text(60_000)
    options = CorpusOptions(**TINY, tokenizer_sample=20_000)
    given = []
    real = corpus_sample.train_tokenizer_on_slices
    monkeypatch.setattr(
        corpus_sample,
        "train_tokenizer_on_slices",
        lambda slices, *a, **k: given.extend(slices) or real(slices, *a, **k),
    )
    prepared = prepare_corpus([write_text(tmp_path / "a.txt", text)], options, quiet)
    assert abs(sum(map(len, given)) - 20_000) <= TRAINER_SLICE  # whole slices, as near the bound as they come
    whole = train_tokenizer(text[: int(0.9 * len(text))], 300, log=quiet)
    assert prepared.tokenizer.model_proto != whole.model_proto  # trained on a third of the text
    assert prepared.tokenizer.decode(prepared.train_ids[1:].tolist()) == text[: int(0.9 * len(text))]


KILLABLE = dict(vocab_size=300, chunk_chars=1000, piece_chars=61, workers=1)


def run_prepare(corpus: Path, cache: Path) -> subprocess.Popen:
    code = (
        "import sys; from aftgen.corpus import CorpusOptions, prepare_corpus; "
        f"prepare_corpus([sys.argv[1]], CorpusOptions(**{KILLABLE!r}), log=lambda _: None)"
    )
    env = {**os.environ, "AFTGEN_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, "-c", code, str(corpus)], env=env, stderr=subprocess.PIPE, text=True)


APPEND = corpus_cache.TokenFiles.append


def counting_appends(monkeypatch) -> list:
    """Record each chunk appended to the token files from now on."""
    appended = []
    monkeypatch.setattr(corpus_cache.TokenFiles, "append", lambda self, *a: appended.append(a) or APPEND(self, *a))
    return appended


def test_sigkill_during_preparation_leaves_a_cache_the_next_run_continues(tmp_path, monkeypatch):
    corpus = write_text(tmp_path / "a.txt", corpus_text(200_000))
    process = run_prepare(corpus, tmp_path / "killed")
    deadline = time.monotonic() + 120  # a safety net against a hung process, not a speed requirement
    while not list((tmp_path / "killed").glob("corpora/*/tokens-*/progress.json")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1]
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)  # a few chunks in, at any point of one
    process.wait()
    (progress_file,) = (tmp_path / "killed").glob("corpora/*/tokens-*/progress.json")
    with open(progress_file.parent / "train.bin", "ab") as handle:
        handle.write(b"\x07\x00" * 5)  # as if killed in the middle of appending a chunk
    appended = counting_appends(monkeypatch)
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path / "killed"))
    continued = prepare_corpus([corpus], CorpusOptions(**KILLABLE), quiet)
    continued_chunks = len(appended)
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path / "fresh"))
    fresh = prepare_corpus([corpus], CorpusOptions(**KILLABLE), quiet)
    assert 0 < continued_chunks < len(appended) - continued_chunks  # carried on, not from zero
    assert torch.equal(continued.train_ids[:], fresh.train_ids[:])
    assert torch.equal(continued.held_out_ids, fresh.held_out_ids)
    assert not progress_file.exists()


def test_an_interrupted_preparation_is_continued_in_process(tmp_path, monkeypatch):
    corpus = write_text(tmp_path / "a.txt", corpus_text(40_000))
    options = CorpusOptions(**TINY)
    fresh = prepare_corpus([corpus], options, quiet)
    shutil.rmtree(tmp_path / "cache")

    class Crash(Exception):
        pass

    def append_then_crash(self, part, ids, progress):
        if part == "train" and progress["tokens"] > 5000:  # some way into the training part
            raise Crash
        APPEND(self, part, ids, progress)

    monkeypatch.setattr(corpus_cache.TokenFiles, "append", append_then_crash)
    with pytest.raises(Crash):
        prepare_corpus([corpus], options, quiet)
    appended = counting_appends(monkeypatch)
    continued = prepare_corpus([corpus], options, quiet)
    assert appended[0][0] == "train" and appended[0][2]["tokens"] > 5000  # it went on from the last chunk
    assert torch.equal(continued.train_ids[:], fresh.train_ids[:])
    assert torch.equal(continued.held_out_ids, fresh.held_out_ids)


def test_train_on_a_folder_records_the_held_out_documents(tmp_path, one_thread):
    from conftest import train_tiny

    folder = make_folder(tmp_path / "corpus")
    out = train_tiny([folder], tmp_path / "run", max_steps=2, eval_interval=1)
    info = json.loads((out / "training.json").read_text())
    assert info["corpus"] == [str(folder)] and info["held_out"]["rule"] == "documents"
    assert info["held_out"]["documents"] and info["held_out"]["chars"] == info["final_eval"]["chars"]
    assert "whole documents" in (out / "README.md").read_text()


def test_prepare_prints_the_cache_and_a_second_run_reuses_it(tmp_path):
    path = write_text(tmp_path / "a.txt", corpus_text(20_000))
    first = invoke("prepare", path, "--vocab-size", 300)
    assert first.exit_code == 0, first.output
    folder = Path(first.stdout.strip())
    assert (folder / "train.bin").is_file() and "encoding" in first.stderr
    second = invoke("prepare", path, "--vocab-size", 300)
    assert second.stdout == first.stdout and "encoding" not in second.stderr
    manifest = json.loads((folder / "tokens.json").read_text())
    tokens = manifest["parts"]["train"]["tokens"]
    assert (folder / "train.bin").stat().st_size == 2 * tokens and np.dtype(manifest["dtype"]) == np.uint16
    with pytest.raises(AftgenError, match="must be positive"):
        prepare_corpus([path], CorpusOptions(held_out=0), quiet)
