"""The tokenizer's vocabulary of a fresh run with a time budget, chosen from the text and the machine.

A larger vocabulary packs more characters into a token, so a step of the same tokens reads more text, but
its embedding and softmax make the step slower. Within a time budget the model learns about as well as the
text it reads: on issue 49's grid (docs/recipe.md) the vocabulary that read the most characters in the budget
was the best, or within the noise of it, wherever the budget, not the text, was the limit. Where the budget
buys many passes over a small text, the text is the limit and the default stays.

So: a tokenizer of each candidate size is trained on a small sample of the training text (its even slices),
its characters a token measured on the sample's other slices; the probe times each one's training step at the
run's preset; the candidate that reads the most characters a second wins, unless the default reads within
KEEP_WITHIN of it. `--vocab-size` wins over all of this, a budget in steps keeps the default (with no clock,
every step of a larger vocabulary reads more), and fine-tuning and resumed runs keep their tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from aftgen.corpus import CorpusOptions
from aftgen.corpus.sample import evenly
from aftgen.tokenizer import train_tokenizer_on_slices
from aftgen.training.recipe import fastest_of

DEFAULT = CorpusOptions.vocab_size
CANDIDATES = (1024, 2048, 4096)  # smallest first; 512 left too few pieces beyond the characters of varied text
SAMPLE_CHARS = 2_000_000  # the candidates' tokenizers train on half of it, in about a second each
KEEP_WITHIN = 0.03  # the default stays where it reads within 3% of the best: the probe's own noise
DATA_LIMITED_PASSES = 4.0  # at more passes over the text than this, the text is the limit: the default stays
TOO_SMALL = 200_000  # training characters below which nothing is measured (the text is the limit)


@dataclass(frozen=True)
class Candidate:
    """A vocabulary as measured: its characters a token on the sample and its training tokens a second."""

    vocab: int
    chars_per_token: float
    tokens_per_s: float

    @property
    def chars_per_s(self) -> float:
        return self.chars_per_token * self.tokens_per_s


@dataclass(frozen=True)
class Choice:
    """The vocabulary chosen, why, and what it was chosen from (training.json records it)."""

    vocab: int
    why: str
    candidates: tuple[Candidate, ...] = ()

    def describe(self) -> str:
        measured = ", ".join(
            f"{c.vocab}: {c.chars_per_token:.2f} chars/token x {c.tokens_per_s:,.0f} tok/s" for c in self.candidates
        )
        return f"vocabulary: {self.vocab} pieces ({self.why})" + (f"; measured {measured}" if measured else "")

    def to_dict(self) -> dict:
        return asdict(self)


def choose(candidates: Sequence[Candidate], train_chars: int, budget_s: float) -> Choice:
    """The rule, from the candidates as measured (the default among them), the training text's characters and the
    time budget."""
    default, measured = next(c for c in candidates if c.vocab == DEFAULT), tuple(candidates)
    passes = budget_s * default.chars_per_s / max(train_chars, 1)
    if passes > DATA_LIMITED_PASSES:
        return Choice(DEFAULT, f"the budget reads the text {passes:.0f} times: the text is the limit", measured)
    best = max(candidates, key=lambda c: c.chars_per_s)
    if default.chars_per_s >= (1 - KEEP_WITHIN) * best.chars_per_s:
        return Choice(DEFAULT, "it reads the most text in the budget, or within 3% of it", measured)
    gain = best.chars_per_s / default.chars_per_s - 1
    return Choice(best.vocab, f"it reads {gain:.0%} more text in the budget than {DEFAULT}", measured)


def decide(
    slices: list[str], train_chars: int, budget_s: float, tokenizer_type: str, speed: Callable[[int], float],
    log: Callable[[str], None],
) -> Choice:  # fmt: skip
    """The vocabulary for `train_chars` of training text in `budget_s` seconds: the default below TOO_SMALL, else
    `choose` from the candidates as `measure` finds them on `slices` (the tokenizer's training text)."""
    if train_chars < TOO_SMALL:
        return Choice(DEFAULT, "too little text to measure: the text is the limit")
    return choose(measure(slices, tokenizer_type, speed, log), train_chars, budget_s)


def measure(
    slices: list[str], tokenizer_type: str, speed: Callable[[int], float], log: Callable[[str], None]
) -> list[Candidate]:
    """Each candidate measured: a tokenizer trained on the even slices of a SAMPLE_CHARS sample of `slices` (the
    tokenizer's training text), its characters a token on the odd ones, and `speed(vocab)`: training tokens/s,
    the best of recipe.ROUNDS (recipe.fastest_of)."""
    sample = list(evenly(slices, sum(map(len, slices)), SAMPLE_CHARS))
    learn, read = sample[::2], sample[1::2] or sample
    read_chars = sum(map(len, read))
    log(f"measuring vocabularies of {', '.join(map(str, CANDIDATES))} pieces on {sum(map(len, sample)):,} characters")
    chars_per_token = {}
    for vocab in CANDIDATES:
        tokenizer = train_tokenizer_on_slices(learn, vocab, tokenizer_type, log=lambda _: None)
        tokens = sum(map(len, tokenizer.sp.encode(read)))  # the slices are the trainer's text: escaped already
        chars_per_token[vocab] = read_chars / max(tokens, 1)
    speeds = fastest_of(CANDIDATES, speed)
    return [Candidate(vocab, chars_per_token[vocab], speeds[vocab]) for vocab in CANDIDATES]
