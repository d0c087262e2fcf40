"""scripts/make_corpora.py on a fake installed tree: documents kept whole and never split between train and
held-out, one held-out set for every size, sizes that nest, the same corpora for the same seed, and links and
FIFOs in the tree passed over without being opened."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import sys
from pathlib import Path

import pytest
from conftest import WORDS

SCRIPT = Path(__file__).parent.parent / "scripts" / "make_corpora.py"


@pytest.fixture(scope="module")
def corpora():
    spec = importlib.util.spec_from_file_location("make_corpora", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_corpora"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def document(index: int) -> str:
    """A document of a few paragraphs (blank lines inside it), unique by its first line."""
    rng = random.Random(index)
    paragraphs = [" ".join(rng.choices(WORDS, k=rng.randint(5, 30))) for _ in range(rng.randint(1, 4))]
    return f"Document {index}\n\n" + "\n\n".join(paragraphs) + "\n"


@pytest.fixture
def tree(tmp_path, corpora):
    """60 documents in a Sphinx _sources folder (one gzipped, one a duplicate), a fortune file of 5 entries, a
    FIFO and a link to a file outside the tree; and the sources that read it."""
    root = tmp_path / "root"
    sources = root / "usr/share/doc/a-doc/html/_sources"
    (sources / "part").mkdir(parents=True)
    for index in range(60):
        (sources / "part" / f"{index:02}.rst.txt").write_text(document(index))
    (sources / "part/00.rst.txt").unlink()
    (sources / "zipped.rst.txt.gz").write_bytes(gzip.compress(document(0).encode()))
    (sources / "again.rst.txt").write_text(document(1))
    (tmp_path / "secret.txt").write_text("Outside the tree\n")
    (sources / "link.rst.txt").symlink_to(tmp_path / "secret.txt")
    os.mkfifo(sources / "fifo.rst.txt")
    fortunes = root / "usr/share/games/fortunes"
    fortunes.mkdir(parents=True)
    (fortunes / "wisdom").write_text("%\n".join(f"Fortune {index}\n" for index in range(5)))
    (fortunes / "wisdom.dat").write_bytes(b"\0\1binary index")
    listed = (corpora.Source("a-doc", "usr/share/doc/a-*/html/_sources", r"\.txt(\.gz)?$"),
              corpora.Source("fortunes", "usr/share/games/fortunes", r"^[^./]+$", entries=True))  # fmt: skip
    return root, listed


def make(corpora, tree, out: Path, seed: int = 0) -> list[dict]:
    root, sources = tree
    return corpora.make_sized(corpora.collect(sources, root), out, "docs", [0.005, 0.01], seed, held_out_mb=0.002)


def every_document() -> list[str]:
    return [document(index) for index in range(60)] + [f"Fortune {index}\n" for index in range(5)]


def test_each_document_is_read_once_and_whole_and_links_and_fifos_are_passed_over(corpora, tree, capsys):
    root, sources = tree
    texts = [found.text for found in corpora.collect(sources, root)]
    assert sorted(texts) == sorted(every_document())  # the gzipped one read, the duplicate and .dat left out
    assert capsys.readouterr().err == ""  # the link and the FIFO were passed over, not opened and refused


def test_documents_stay_whole_and_held_out_ones_are_in_no_train_text(corpora, tree, tmp_path):
    made = make(corpora, tree, tmp_path / "out")
    train = (tmp_path / "out/docs-0.01mb/train.txt").read_text()
    held_out = (tmp_path / "out/docs-0.01mb/held_out.txt").read_text()
    written = 0
    for text in every_document():
        first_line = text.split("\n")[0] + "\n"
        whole = train.count(text) + held_out.count(text)
        assert whole == train.count(first_line) + held_out.count(first_line) <= 1, text[:20]
        written += whole
    assert made[-1]["held_out"]["documents"] > 0 and made[-1]["train"]["documents"] > 0
    assert written == made[-1]["train"]["documents"] + made[-1]["held_out"]["documents"]


def test_sizes_nest_and_share_one_held_out_set(corpora, tree, tmp_path):
    made = make(corpora, tree, tmp_path / "out")
    small, large = (tmp_path / "out/docs-0.005mb", tmp_path / "out/docs-0.01mb")
    assert (small / "held_out.txt").read_bytes() == (large / "held_out.txt").read_bytes()
    small_train, large_train = (small / "train.txt").read_text(), (large / "train.txt").read_text()
    assert 5_000 <= made[0]["train"]["bytes"] < made[1]["train"]["bytes"]
    assert large_train.startswith(small_train) and len(small_train) < len(large_train)
    manifest = json.loads((small / "manifest.json").read_text())
    assert manifest["seed"] == 0 and [source["package"] for source in manifest["sources"]] == ["a-doc", "fortunes"]


def test_a_seed_makes_the_same_corpora_and_another_seed_others(corpora, tree, tmp_path):
    for name, seed in (("one", 0), ("two", 0), ("three", 1)):
        make(corpora, tree, tmp_path / name, seed)
    text = {name: (tmp_path / name / "docs-0.005mb/train.txt").read_bytes() for name in ("one", "two", "three")}
    assert text["one"] == text["two"] != text["three"]


def test_too_little_text_is_one_error_before_anything_is_written(corpora, tree, tmp_path):
    root, sources = tree
    with pytest.raises(corpora.AftgenError, match="less than 1 MB"):
        corpora.make_sized(corpora.collect(sources, root), tmp_path / "out", "docs", [0.005, 1], 0, 0.002)
    assert not (tmp_path / "out").exists()
