"""Reading a corpus's files (aftgen/corpus/sources.py): a bad file is one line naming it, or skipped when asked."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from bad_input import assert_one_error, invoke
from conftest import make_corpus
from corpus_texts import make_folder


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
