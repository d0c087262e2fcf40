"""A corpus's files: found in folders by a glob, checked and read as text in blocks, never whole.

Anything that is not text (a binary file, an unreadable one, bytes that do not decode, a FIFO or a
device) is one clear error naming the file, or, with --skip-bad-files, a warning and a count.
"""

from __future__ import annotations

import codecs
import hashlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from aftgen import files
from aftgen.errors import AftgenError

DEFAULT_GLOB = "*.txt"
DECODE_ERRORS = ("strict", "replace", "ignore")  # what --errors takes: Python's ways with undecodable bytes
BLOCK_BYTES = 1 << 22  # read 4 MiB at a time
NUL_SHARE = 1000  # more than one NUL byte in this many means binary (or UTF-16) rather than UTF-8 text


class BadFile(AftgenError):
    """A file that is not usable text (--skip-bad-files skips it)."""


@dataclass(frozen=True)
class Document:
    """One file of a corpus as scanned: how much text it holds, and a hash of its bytes."""

    path: Path
    size: int  # bytes on disk
    chars: int
    nbytes: int  # UTF-8 bytes of its text: what bits/byte counts
    digest: str  # SHA-256 of the file's bytes


def find_files(sources: Sequence[Path | str], glob: str = DEFAULT_GLOB, leave_out: Sequence[Path] = ()) -> list[Path]:
    """Each file named, and each regular file under each folder named (recursively, sorted, hidden ones
    left out) whose name matches `glob`; a file reached twice counts once. FIFOs and devices in a folder
    are left out like hidden files; one named is refused when it is read. Files under the folders
    `leave_out` (a run's own folder inside a corpus folder: its records are not text to train on) are
    left out of the folders' files."""
    if not sources:
        raise AftgenError("no corpus given: pass one or more text files or folders")
    left_out = [Path(folder).resolve() for folder in leave_out]
    found: dict[Path, Path] = {}
    for source in map(Path, sources):
        if source.is_dir():
            _refuse_left_out(source, left_out)
            inside = sorted(
                p
                for p in source.rglob(glob)
                if p.is_file() and not _hidden(p.relative_to(source)) and not _inside(p.resolve(), left_out)
            )
            if not inside:
                raise AftgenError(f"{source}: no files matching '{glob}' in this folder; pass --glob PATTERN")
        elif source.exists():
            inside = [source]
        else:
            raise AftgenError(f"{source}: no such file or folder")
        for path in inside:
            found.setdefault(path.resolve(), path)
    return list(found.values())


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _inside(path: Path, folders: Sequence[Path]) -> bool:
    return any(path.is_relative_to(folder) for folder in folders)


def _refuse_left_out(source: Path, left_out: Sequence[Path]) -> None:
    """A corpus folder that is itself a left-out folder, or inside one, would hold no corpus at all."""
    if _inside(source.resolve(), left_out):
        raise AftgenError(
            f"{source}: this corpus folder is the run folder (--out) or inside it; "
            "choose a run folder outside the corpus"
        )


def check_encoding(encoding: str, errors: str) -> None:
    """Refuse an unknown encoding or error mode before any file is read."""
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise AftgenError(f"unknown encoding '{encoding}'") from None
    if errors not in DECODE_ERRORS:
        raise AftgenError(f"--errors must be {', '.join(DECODE_ERRORS[:-1])} or {DECODE_ERRORS[-1]}, got '{errors}'")


def _blocks(path: Path, encoding: str, errors: str) -> Iterator[tuple[bytes, str]]:
    """(raw bytes, their text) block by block; BadFile for a file that cannot be read or is not text."""
    decoder = codecs.getincrementaldecoder(encoding)(errors=errors)
    utf8 = codecs.lookup(encoding).name == "utf-8"
    read = nuls = 0
    try:
        with _open_regular(path) as handle:
            while block := handle.read(BLOCK_BYTES):
                nuls += block.count(b"\x00") if utf8 else 0
                try:
                    text = decoder.decode(block)
                except UnicodeDecodeError as exc:
                    _refuse_binary(path, nuls, read + len(block))
                    offset = read - len(decoder.getstate()[0]) + exc.start
                    raise BadFile(
                        f"{path}: not valid {encoding} (bad byte at offset {offset}); "
                        "pass --encoding or --errors replace"
                    ) from None
                read += len(block)
                yield block, text
            yield b"", decoder.decode(b"", final=True)
    except UnicodeDecodeError:  # an unfinished character at the very end
        raise BadFile(f"{path}: not valid {encoding} (ends inside a character); pass --errors replace") from None
    except OSError as exc:
        raise BadFile(f"{path}: cannot read ({exc.strerror or exc})") from None
    _refuse_binary(path, nuls, read)


def _open_regular(path: Path) -> BinaryIO:
    """`path` opened through the files door (a regular file of any size; a FIFO or device is refused at once,
    never read); BadFile if not, so that --skip-bad-files can skip it."""
    try:
        return files.open_regular(path, sys.maxsize, "text file")
    except AftgenError as exc:
        raise BadFile(str(exc)) from None


def _refuse_binary(path: Path, nuls: int, read: int) -> None:
    # A stray NUL is just a character; many of them mean a binary file (or UTF-16 text).
    if nuls * NUL_SHARE > read:
        raise BadFile(f"{path}: full of NUL bytes, so it looks binary; pass a text file (or --encoding utf-16)")


def scan_file(
    path: Path, encoding: str = "utf-8", errors: str = "strict", keep: Callable[[str], None] | None = None, advance=None
) -> Document:
    """Read `path` once, in blocks: check that it holds text, count it and hash its bytes (`keep` gets the
    text, `advance` the number of bytes read)."""
    check_encoding(encoding, errors)
    if path.is_dir():
        raise AftgenError(f"{path}: is a directory, expected a text file")
    if not path.exists():
        raise AftgenError(f"{path}: no such file")
    digest = hashlib.sha256()
    size = chars = nbytes = 0
    blank, as_read = True, codecs.lookup(encoding).name == "utf-8" and errors == "strict"
    for block, text in _blocks(path, encoding, errors):
        digest.update(block)
        if advance is not None:
            advance(len(block))
        size, chars = size + len(block), chars + len(text)
        nbytes += len(block) if as_read else len(text.encode("utf-8", "replace"))
        blank = blank and (not text or text.isspace())
        if keep is not None:
            keep(text)
    if not size:
        raise BadFile(f"{path}: file is empty")
    if blank:
        raise BadFile(f"{path}: file holds only whitespace")
    return Document(path=path, size=size, chars=chars, nbytes=nbytes, digest=digest.hexdigest())


def read_text(path: Path | str, encoding: str = "utf-8", errors: str = "strict") -> str:
    """A whole (small) text file, with one clear error for anything that is not readable text."""
    parts: list[str] = []
    scan_file(Path(path), encoding, errors, keep=parts.append)
    return "".join(parts)


def read_document(document: Document, encoding: str = "utf-8", errors: str = "strict") -> Iterator[str]:
    """The text of a scanned document, block by block."""
    for _, text in _verified_blocks(document, encoding, errors):
        yield text


def _verified_blocks(document: Document, encoding: str, errors: str) -> Iterator[tuple[bytes, str]]:
    """_blocks of a scanned document; refuses a file that changed since it was scanned, so that no cache
    ever holds the tokens of other text under its hash."""
    digest = hashlib.sha256()
    for block, text in _blocks(document.path, encoding, errors):
        digest.update(block)
        yield block, text
    if digest.hexdigest() != document.digest:
        raise AftgenError(f"{document.path} changed while being prepared; run again")


def read_span(
    document: Document, start: int, stop: int, encoding: str, errors: str, advance: Callable[[int], None] | None = None
) -> Iterator[str]:
    """Characters [start, stop) of a scanned document, block by block. The file is read from its start;
    `advance` is told about how many of the bytes read belong to the span."""
    position = 0
    for block, text in _verified_blocks(document, encoding, errors):
        low, high = max(start - position, 0), min(stop - position, len(text))
        position += len(text)
        if low < high:
            if advance is not None:
                advance(len(block) * (high - low) // len(text))
            yield text[low:high]
        if position > stop:  # read on to the end of a whole document: its hash is checked there
            return
