"""Corpus preparation: chunked encoding is exact, a killed preparation is continued, bad files get one line,
folders are split into whole documents, and the final eval streams."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEVICE, make_corpus
from typer.testing import CliRunner

from aftgen.cli import app
from aftgen.corpus import CorpusOptions, prepare_corpus
from aftgen.corpus import cache as corpus_cache
from aftgen.corpus import sample as corpus_sample
from aftgen.corpus.sample import evenly
from aftgen.corpus.sources import Document
from aftgen.corpus.split import split_corpus
from aftgen.errors import AftgenError
from aftgen.tokenizer import TRAINER_SLICE, train_tokenizer

runner = CliRunner()
# Tiny chunks and pieces, so that every text below is cut many times.
TINY = dict(vocab_size=300, chunk_chars=997, piece_chars=61, workers=2)
ODD = "  double  spaces,\ttabs,\r\nwindows lines, \u2581 meta, \ue000 escape, caf\u00e9, \u65e5\u672c, \U0001f600 "


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path / "cache"))


def quiet(_: str) -> None:
    pass


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())
    return path


def corpus_text(chars: int, seed: int = 0) -> str:
    text = make_corpus(chars, seed)
    return text[: chars // 3] + ODD + text[chars // 3 : 2 * chars // 3] + ODD * 3 + text[2 * chars // 3 :]


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


def make_folder(root: Path, files: int = 30) -> Path:
    for index in range(files):
        write_text(root / f"part{index % 3}" / f"doc{index:02d}.txt", make_corpus(1000 + 97 * index, seed=index))
    write_text(root / ".hidden" / "secret.txt", "never read")
    write_text(root / "notes.md", make_corpus(2000, seed=99))
    return root


def test_a_folder_is_documents_and_whole_ones_are_held_out(tmp_path):
    folder = make_folder(tmp_path / "corpus")
    prepared = prepare_corpus([folder], CorpusOptions(**TINY), quiet)
    files = sorted(folder.rglob("doc*.txt"))
    held = [Path(d["file"]) for d in prepared.held_out["documents"]]
    assert prepared.held_out["rule"] == "documents" and set(held) < set(files)
    texts = {path: path.read_text() for path in files}
    held_chars = sum(len(texts[path]) for path in held)
    assert held_chars == prepared.held_out_chars and 0.05 < held_chars / sum(map(len, texts.values())) <= 0.1
    tokenizer, bos = prepared.tokenizer, prepared.tokenizer.bos_id
    expected_held = [i for path in held for i in [bos, *tokenizer.encode(texts[path])]]
    expected_train = [i for path in files if path not in held for i in [bos, *tokenizer.encode(texts[path])]]
    assert prepared.held_out_ids.tolist() == expected_held
    assert prepared.train_ids[:].tolist() == expected_train

    moved = shutil.copytree(folder, tmp_path / "elsewhere")  # the choice follows contents, not places
    again = prepare_corpus([moved], CorpusOptions(**TINY), quiet)
    assert [Path(d["file"]).relative_to(moved) for d in again.held_out["documents"]] == [
        path.relative_to(folder) for path in held
    ]
    markdown = prepare_corpus([folder], CorpusOptions(**TINY, glob="*.md"), quiet)
    assert markdown.summary["documents"] == 1


def document(chars: int, name: str) -> Document:
    return Document(path=Path(name), size=chars, chars=chars, nbytes=chars, digest=name * 8)


def test_held_out_split_rules_and_cap():
    (one,) = docs = [document(1_115_394, "a")]
    assert split_corpus(docs).held_out[0].start == int(0.9 * one.chars)  # Tiny Shakespeare's split
    assert split_corpus(docs, cap=1000).held_out[0].start == one.chars - 1000
    many = [document(1000 + index, f"d{index}") for index in range(50)]
    split = split_corpus(many)
    assert split == split_corpus(many) and split.rule == "documents"
    assert sum(s.chars for s in split.held_out) <= 0.1 * sum(d.chars for d in many)
    capped = split_corpus(many, cap=2500)
    assert len(capped.held_out) == 2
    assert {s.document for s in capped.train}.isdisjoint(s.document for s in capped.held_out)
    big = [document(10_000, "x"), document(12_000, "y")]  # no whole document fits in 10%
    tail = split_corpus(big)
    assert tail.rule == "tail" and tail.held_out[0].chars == 2200 and sum(s.chars for s in tail.train) == 19_800


def invoke(*args) -> object:
    return runner.invoke(app, [str(a) for a in args])


def assert_one_error(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.search(message, lines[0]), result.stderr
    assert "Traceback" not in result.output


def bad_files() -> dict[str, bytes]:
    return {
        "picture.txt": bytes(range(256)) * 8,
        "latin1.txt": make_corpus(3000, seed=5).replace("e", "\xe9").encode("latin-1"),
        "locked.txt": make_corpus(3000, seed=6).encode(),
    }


@pytest.mark.parametrize("bad", list(bad_files()))
def test_a_bad_file_in_a_folder_is_one_line_naming_it_or_skipped(tmp_path, monkeypatch, bad):
    folder = make_folder(tmp_path / "corpus", files=6)
    (folder / bad).write_bytes(bad_files()[bad])
    real_open = os.open

    def no_permission(path, *args, **kwargs):
        if Path(path).name == "locked.txt":
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_permission)  # root reads any file: the refusal a user would get
    messages = {"picture.txt": "looks binary", "latin1.txt": "not valid utf-8", "locked.txt": "cannot read"}
    assert_one_error(invoke("prepare", folder, "--vocab-size", 300), rf"{bad}: .*{messages[bad]}.*--skip-bad-files")
    skipped = invoke("prepare", folder, "--vocab-size", 300, "--skip-bad-files")
    assert skipped.exit_code == 0, skipped.output
    assert re.search(rf"warning: skipping .*{bad}: ", skipped.stderr) and "skipped 1 bad file, kept 6" in skipped.stderr
    assert Path(skipped.stdout.strip()).is_dir()


def test_empty_folders_and_globs_matching_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_error(invoke("train", tmp_path / "empty"), "empty: no files matching '\\*.txt'")
    folder = make_folder(tmp_path / "corpus", files=3)
    assert_one_error(invoke("prepare", folder, "--glob", "*.csv"), "no files matching '\\*.csv'.*--glob")
    assert_one_error(invoke("prepare", tmp_path / "nope"), "nope: no such file or folder")
    assert_one_error(invoke("prepare", folder, "--held-out", "lots"), "cannot read size 'lots'")
    (tmp_path / "bad").mkdir()
    for name, content in bad_files().items():
        (tmp_path / "bad" / name).write_bytes(content[:2000] if name != "locked.txt" else b"")
    assert_one_error(
        invoke("prepare", tmp_path / "bad", "--skip-bad-files"), "no usable text .*all 3 files were skipped"
    )


def test_train_on_a_folder_records_the_held_out_documents(tmp_path, one_thread):
    from conftest import train_tiny

    folder = make_folder(tmp_path / "corpus")
    out = train_tiny([folder], tmp_path / "run", max_steps=2, eval_interval=1)
    info = json.loads((out / "training.json").read_text())
    assert info["corpus"] == [str(folder)] and info["held_out"]["rule"] == "documents"
    assert info["held_out"]["documents"] and info["held_out"]["chars"] == info["final_eval"]["chars"]
    assert "whole documents" in (out / "README.md").read_text()


def test_eval_streams_a_file_in_chunks(tmp_path, tiny_run, monkeypatch, one_thread):
    import aftgen
    from aftgen import evaluate
    from aftgen.corpus.sources import scan_file

    model, tokenizer = aftgen.load(tiny_run, device=DEVICE)
    text = corpus_text(8000)
    path = write_text(tmp_path / "held.txt", text)
    whole = evaluate.evaluate_text(model, tokenizer, text, reset_every=100)
    monkeypatch.setattr(evaluate, "CHUNK_CHARS", 333)  # many chunks, each cut safely
    streamed = evaluate.evaluate_file(model, tokenizer, scan_file(path), reset_every=100)
    assert streamed.tokens == whole.tokens and streamed.chars == whole.chars
    assert streamed.nats_per_char == pytest.approx(whole.nats_per_char, rel=1e-5)
    assert streamed.bits_per_byte == pytest.approx(whole.bits_per_byte, rel=1e-5)
    ids = torch.tensor([tokenizer.bos_id, *tokenizer.encode(text)])
    pieces = [ids[:5], ids[5:1500], ids[1500:]]
    assert torch.allclose(
        torch.cat(list(evaluate.score_stream(model, pieces, chunk=64))), evaluate.stream_nll(model, ids)
    )


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


def _manifest_without(field: str):
    def damage(folder: Path) -> None:
        manifest = json.loads((folder / "tokens.json").read_text())
        del manifest["parts"]["train"][field]
        (folder / "tokens.json").write_text(json.dumps(manifest))

    return damage


def _id_past_the_vocabulary(folder: Path) -> None:
    with open(folder / "train.bin", "r+b") as handle:
        handle.seek(2 * 7)
        handle.write(np.array([65535], dtype=np.uint16).tobytes())


def _unfinished_with_an_impossible_span(folder: Path) -> None:
    manifest = json.loads((folder / "tokens.json").read_text())
    (folder / "tokens.json").unlink()
    progress = manifest["parts"] | {"train": {"span": 99, "char": 0, "tokens": 0, "bytes": 0}}
    (folder / "progress.json").write_text(json.dumps(progress))


NESTED = "[" * 100_000 + "]" * 100_000  # deeper than Python's json can read


def _unfinished_with_nested_progress(folder: Path) -> None:
    (folder / "tokens.json").unlink()
    (folder / "progress.json").write_text(NESTED)


@pytest.mark.parametrize(
    "damage",
    [
        lambda folder: (folder / "tokens.json").write_text("{}"),
        lambda folder: (folder / "tokens.json").write_text("[]"),
        lambda folder: (folder / "tokens.json").write_text("null"),
        lambda folder: (folder / "tokens.json").write_text('{"dtype": "uint16", "parts": {"train": 5}'),
        _manifest_without("bytes"),
        _id_past_the_vocabulary,
        _unfinished_with_an_impossible_span,
        lambda folder: (folder / "tokens.json").write_text(NESTED),
        _unfinished_with_nested_progress,
    ],
    ids=["empty object", "list", "null", "truncated", "no bytes", "id past vocabulary", "impossible span"]
    + ["nested 100k deep", "progress nested 100k deep"],
)
def test_a_damaged_cache_entry_is_prepared_again_with_a_warning(tmp_path, damage):
    path = write_text(tmp_path / "a.txt", corpus_text(20_000))
    first = invoke("prepare", path, "--vocab-size", 300)
    folder = Path(first.stdout.strip())
    tokens = {part: (folder / f"{part}.bin").read_bytes() for part in ("train", "held_out")}
    damage(folder)
    again = invoke("prepare", path, "--vocab-size", 300)
    assert again.exit_code == 0, again.output
    warnings = [line for line in again.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "is damaged" in warnings[0] and "encoding" in again.stderr, again.stderr
    assert {part: (folder / f"{part}.bin").read_bytes() for part in tokens} == tokens
    assert invoke("prepare", path, "--vocab-size", 300).stderr.count("warning") == 0  # whole again
