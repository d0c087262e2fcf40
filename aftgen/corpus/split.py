"""The held-out split: the text the model never trains on, so that its score means something.

One file keeps the rule every published Tiny Shakespeare number used: its last 10% of characters.
Several files: whole documents, in an order fixed by a seed and their contents (not their names or
places), chosen to make about 10% of the text. Either way the held-out part is capped, as nanoGPT
holds out 0.05% of OpenWebText: its final eval reads every held-out token.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from aftgen.corpus.sources import Document
from aftgen.errors import AftgenError

HELD_OUT_FRACTION = 0.1
# At most this many held-out characters: preset small scores them in well under a minute on 2 CPU cores.
DEFAULT_HELD_OUT = 1_000_000
SPLIT_SEED = 2357  # nanoGPT's seed for its OpenWebText split
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmg]?)")


@dataclass(frozen=True)
class Span:
    """Characters [start, stop) of document number `document`."""

    document: int
    start: int
    stop: int

    @property
    def chars(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Split:
    train: tuple[Span, ...]
    held_out: tuple[Span, ...]
    rule: str  # "tail": the end of one document; "documents": whole documents


def split_corpus(documents: Sequence[Document], cap: int = DEFAULT_HELD_OUT) -> Split:
    """Hold out the last 10% of one document, or whole documents making about 10% of several; `cap` characters
    at most. Where no document is small enough, the end of the first one in the seeded order is held out."""
    if len(documents) == 1:
        chars = documents[0].chars
        return _tail(documents, 0, max(int((1 - HELD_OUT_FRACTION) * chars), chars - cap))
    budget = min(int(HELD_OUT_FRACTION * sum(d.chars for d in documents)), cap)
    order = sorted(range(len(documents)), key=lambda i: (_rank(documents[i]), str(documents[i].path)))
    chosen, taken = set(), 0
    for index in order:
        if taken + documents[index].chars <= budget:
            chosen.add(index)
            taken += documents[index].chars
    if not chosen:
        return _tail(documents, order[0], documents[order[0]].chars - budget)
    train = tuple(Span(i, 0, d.chars) for i, d in enumerate(documents) if i not in chosen)
    return Split(train, tuple(Span(i, 0, documents[i].chars) for i in sorted(chosen)), "documents")


def _rank(document: Document) -> str:
    return hashlib.sha256(f"{SPLIT_SEED}:{document.digest}".encode()).hexdigest()


def _tail(documents: Sequence[Document], index: int, cut: int) -> Split:
    train = tuple(Span(i, 0, cut if i == index else d.chars) for i, d in enumerate(documents))
    held_out = Span(index, cut, documents[index].chars)
    return Split(tuple(span for span in train if span.chars), (held_out,), "tail")


def describe(split: Split, documents: Sequence[Document], cap: int) -> dict:
    """What was held out, exactly, as training.json records it."""
    held = sum(span.chars for span in split.held_out)
    total = sum(d.chars for d in documents)
    if split.rule == "documents":
        summary = f"{len(split.held_out)} whole documents chosen by seed {SPLIT_SEED}, about 10% of the text"
    elif len(documents) == 1:
        capped = held < total - int((1 - HELD_OUT_FRACTION) * total)
        summary = f"the last {held:,} characters (the --held-out cap)" if capped else "the last 10% of the text"
    else:
        summary = "the end of one document (no whole document fits in 10% of the text)"
    return {
        "rule": split.rule,
        "summary": summary,
        "fraction": HELD_OUT_FRACTION,
        "cap_chars": cap,
        "seed": SPLIT_SEED,
        "chars": held,
        "share": round(held / total, 6) if total else 0.0,
        "documents": [
            {"file": str(documents[s.document].path), "from_char": s.start, "to_char": s.stop} for s in split.held_out
        ],
    }


def parse_size(text: str) -> int:
    """'500000', '500k', '2M', '1.5G' -> a number of characters."""
    found = _SIZE.fullmatch(text.strip().lower().replace("_", ""))
    if not found:
        raise AftgenError(f"cannot read size '{text}'; use a number of characters, e.g. 500k, 2M")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[found.group(2)]
    return int(float(found.group(1)) * scale)
