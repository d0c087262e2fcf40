"""The held-out split (aftgen/corpus/split.py): whole documents of a folder, or the tail of one text, within a cap."""

from __future__ import annotations

import shutil
from pathlib import Path

from corpus_texts import TINY, make_folder, quiet

from aftgen.corpus import CorpusOptions, prepare_corpus
from aftgen.corpus.sources import Document
from aftgen.corpus.split import split_corpus


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
