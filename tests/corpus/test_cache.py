"""The preparation cache keeps a set of token files per tokenizer, reused by a later run with the same one, and
prunes a corpus's least recently used sets, never one in use nor through a link (aftgen/corpus/cache.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bad_input import invoke
from conftest import make_corpus
from corpus_texts import corpus_text, write_text

from aftgen.corpus import CorpusOptions, prepare_corpus
from aftgen.corpus import cache as corpus_cache
from aftgen.corpus.cache import IN_USE


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "a.txt"
    path.write_bytes(make_corpus(20_000).encode())
    return path


@pytest.fixture
def encoded(monkeypatch) -> list[Path]:
    """The sets encoded from now on (a chunk appended to their token files)."""
    folders, append = [], corpus_cache.TokenFiles.append

    def counted(self, *args):
        folders.append(self.folder)
        return append(self, *args)

    monkeypatch.setattr(corpus_cache.TokenFiles, "append", counted)
    return folders


def prepare(corpus: Path, vocab_size: int, said: list[str] | None = None) -> Path:
    """The set of a preparation with a tokenizer of `vocab_size`, the preparation dropped (no longer in use)."""
    log = said.append if said is not None else lambda line: None
    return prepare_corpus([corpus], CorpusOptions(vocab_size=vocab_size, workers=1), log).folder


def test_a_tokenizer_used_again_reuses_its_set_and_the_least_recently_used_set_goes(corpus, encoded, monkeypatch):
    monkeypatch.setattr(corpus_cache, "KEEP_SETS", 2)
    said = []
    first, second = prepare(corpus, 300, said), prepare(corpus, 320, said)
    encoded.clear()
    assert prepare(corpus, 300, said) == first and not encoded  # used again: not encoded again
    third = prepare(corpus, 340, said)
    assert first.is_dir() and third.is_dir() and not second.exists()  # the second was the least recently used
    (line,) = [line for line in said if line.startswith("cache:")]
    assert f"removed {second.name} (" in line and "least recently used" in line and "the 2 sets it keeps" in line
    assert sorted(p.name for p in first.parent.glob("tokens-*")) == sorted((first.name, third.name))


def hold_in_use(folder: Path) -> subprocess.Popen:
    """Another process holding a set in use, as a run training on it does."""
    code = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_SH); "
        "print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder / IN_USE)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_set_in_use_by_another_process_is_not_removed(corpus, monkeypatch):
    monkeypatch.setattr(corpus_cache, "KEEP_SETS", 1)
    first = prepare(corpus, 300)
    second = prepare(corpus, 320)
    assert not first.exists()  # pruned: no one used it
    holder = hold_in_use(second)
    try:
        third = prepare(corpus, 340)
        assert second.is_dir() and (second / "train.bin").is_file()  # in use: kept, past the bound
    finally:
        holder.kill()
        holder.wait()
    prepare(corpus, 300)
    assert not second.exists() and not third.exists()


def test_pruning_removes_links_and_fifos_in_a_set_and_never_follows_them(corpus, tmp_path, monkeypatch, no_hang):
    monkeypatch.setattr(corpus_cache, "KEEP_SETS", 1)
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious.txt"
    precious.write_bytes(b"the user's")
    first = prepare(corpus, 300)
    (first / "train.bin").unlink()
    (first / "train.bin").symlink_to(precious)
    (first / "held_out.bin").unlink()
    os.mkfifo(first / "held_out.bin")
    cache = first.parent
    (cache / "tokens-linked").symlink_to(outside, target_is_directory=True)  # not a set: a link
    planted = cache / "tokens-planted"
    planted.mkdir()
    (planted / IN_USE).symlink_to(precious)  # a lock file aftgen did not make: not its to remove
    os.utime(planted, ns=(0, 0))
    prepare(corpus, 320)
    assert not first.exists()
    assert precious.read_bytes() == b"the user's" and sorted(os.listdir(outside)) == ["precious.txt"]
    assert (cache / "tokens-linked").is_symlink() and (planted / IN_USE).is_symlink()


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
