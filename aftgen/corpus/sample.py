"""The tokenizer's training text: a bounded sample drawn evenly from across the whole training split.

The trainer reads the escaped text in slices of 4,096 characters. When the whole training split fits
in the sample, it reads every slice, exactly as `train_tokenizer(train_text)` does (so Tiny
Shakespeare's tokenizer is the one aftgen always trained); otherwise every k-th slice, so the sample
comes from the whole corpus, not just its start. Its memory is bounded by the sample's size, however
large the corpus.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from aftgen.tokenizer import Tokenizer, train_tokenizer_on_slices, trainer_slices

TOKENIZER_SAMPLE = 20_000_000  # characters: SentencePiece trains on them in seconds and under 0.5 GB


def evenly(slices: Iterable[str], total: int, budget: int) -> Iterator[str]:
    """About `budget` characters of `slices` (which hold `total`), taken at even steps; all of them if they fit."""
    for index, piece in enumerate(slices):
        if total <= budget or (index + 1) * budget // total > index * budget // total:
            yield piece


def sample(documents: Iterable[Iterable[str]], total: int, budget: int) -> list[str]:
    """The trainer's slices of `documents` (each one's text in blocks; `total` characters in all): all of them
    when they fit in `budget` characters, else evenly spaced ones making about that many."""
    return list(evenly((piece for texts in documents for piece in trainer_slices(texts)), total, budget))


def train_on_sample(slices: list[str], total: int, options, log: Callable[[str], None]) -> Tokenizer:
    taken = sum(map(len, slices))
    log(
        f"training a {options.tokenizer_type} tokenizer of {options.vocab_size} pieces on "
        + (f"all {total:,} training characters" if taken >= total else f"{taken:,} of {total:,} characters")
    )
    return train_tokenizer_on_slices(slices, options.vocab_size, options.tokenizer_type, log=log)
