"""Texts and folders the corpus tests prepare."""

from __future__ import annotations

from pathlib import Path

from conftest import make_corpus

# Tiny chunks and pieces, so that every text below is cut many times.
TINY = dict(vocab_size=300, chunk_chars=997, piece_chars=61, workers=2)
ODD = "  double  spaces,\ttabs,\r\nwindows lines, \u2581 meta, \ue000 escape, caf\u00e9, \u65e5\u672c, \U0001f600 "


def quiet(_: str) -> None:
    pass


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())
    return path


def corpus_text(chars: int, seed: int = 0) -> str:
    text = make_corpus(chars, seed)
    return text[: chars // 3] + ODD + text[chars // 3 : 2 * chars // 3] + ODD * 3 + text[2 * chars // 3 :]


def make_folder(root: Path, files: int = 30) -> Path:
    for index in range(files):
        write_text(root / f"part{index % 3}" / f"doc{index:02d}.txt", make_corpus(1000 + 97 * index, seed=index))
    write_text(root / ".hidden" / "secret.txt", "never read")
    write_text(root / "notes.md", make_corpus(2000, seed=99))
    return root
