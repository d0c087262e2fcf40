"""Structured output: text that follows a JSON schema, a regular expression, a grammar or a list of choices.

llguidance (the Rust library behind guidance, also in vLLM and llama.cpp) compiles a constraint against the
tokenizer's pieces and gives, before each token, the set of tokens that keep the text a prefix of something
the constraint accepts. The rows that draw (generation.stream.next_tokens) mask their logits with it: a row without a
constraint is left as it is, so it draws what it would draw alone. A constraint is complete when it accepts
and allows nothing more: its row stops there (finish_reason "stop"); one cut short by the token limit ends
with "length", as OpenAI's API does.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aftgen.errors import AftgenError
from aftgen.tokenizer import Tokenizer

# What each kind's source holds: the schema as JSON text, the pattern, a Lark or GBNF grammar, the
# choices as a JSON list of strings.
KINDS = ("json_schema", "regex", "grammar", "choice")
ANY_JSON_OBJECT = '{"type": "object"}'  # response_format {"type": "json_object"}
# No whitespace between JSON tokens: it is where a small model wanders (64 tokens of a sample went mostly on
# newlines and tabs), and text that parses is all that is asked.
JSON_OPTIONS = {"whitespace_flexible": False}
# Compiled constraints kept, by their text (a client sends the same schema again and again), in bytes all told.
# A matcher's size cannot be read from Python: each counts as a bound on it from its grammar's length, which
# holds for the largest enums and objects measured (docs/architecture.md).
KEPT_BYTES = 256 << 20
BYTES_PER_GRAMMAR_BYTE = 160
# llguidance's rows hold one item per alternative plus one, up to its max_items_in_row (2,000 by default).
MAX_CHOICES = 1999
# llguidance's error where no token can extend the text and it is not complete: the constraint accepts no text.
NO_TEXT = "NoExtensionBias"


@dataclass(frozen=True)
class Constraint:
    """What a generation's text must be: `kind` (one of KINDS) and its `source`."""

    kind: str
    source: str


class _Pieces:
    """The tokenizer as llguidance.TokenizerWrapper reads one: each token's bytes, EOS, the special ones."""

    def __init__(self, tokenizer: Tokenizer):
        pieces = [tokenizer.token_bytes(token) for token in range(tokenizer.vocab_size)]
        special = [token for token, piece in enumerate(pieces) if not piece]  # BOS, EOS, <unk>
        # llguidance spells a special token 0xFF + its name, so no text can match it.
        self.tokens = [
            piece or b"\xff" + tokenizer.sp.id_to_piece(token).encode() for token, piece in enumerate(pieces)
        ]
        self.special_token_ids, self.bos_token_id, self.eos_token_id = special, tokenizer.bos_id, tokenizer.sp.eos_id()
        self.encode = tokenizer.encode

    def __call__(self, text: bytes) -> list[int]:
        return self.encode(text.decode("utf-8", errors="replace"))


@functools.lru_cache(maxsize=4)
def _guidance_tokenizer(tokenizer: Tokenizer):
    import llguidance

    if tokenizer.sp.eos_id() < 0:  # aftgen's tokenizers have one: the mask needs a token that means 'done'
        raise AftgenError("structured output needs a tokenizer with an EOS piece, and this one has none")
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Pieces(tokenizer)))


def _grammar(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint (not checked yet: the matcher checks it)."""
    import llguidance

    if constraint.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.source, defaults=JSON_OPTIONS)
    if constraint.kind in KINDS:
        return llguidance.grammar_from(constraint.kind, constraint.source)
    raise AftgenError(f"unknown constraint '{constraint.kind}'; choose one of: {', '.join(KINDS)}")


class ConstraintBroken(AftgenError):
    """A constraint could not go on: llguidance's limits reached, or a token it refused. `rows`: where rows
    were masked together, the message of each one it broke in."""

    def __init__(self, message: str, rows: dict[int, str] | None = None):
        super().__init__(message)
        self.rows = rows or {}


class _Kept:
    """Compiled constraints by their text and tokenizer, the least recently used dropped past `limit` bytes
    (as BYTES_PER_GRAMMAR_BYTE counts them). Any thread may use it."""

    def __init__(self, limit: int):
        self.limit, self.size, self.lock = limit, 0, threading.Lock()
        self.entries: OrderedDict[tuple, tuple[object, int]] = OrderedDict()

    def get(self, key: tuple):
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.entries.move_to_end(key)
            return entry and entry[0]

    def put(self, key: tuple, matcher: object, size: int) -> None:
        with self.lock:
            if size > self.limit or key in self.entries:
                return
            self.entries[key], self.size = (matcher, size), self.size + size
            while self.size > self.limit:
                _, (_, dropped) = self.entries.popitem(last=False)
                self.size -= dropped


_kept = _Kept(KEPT_BYTES)


def compiled(constraint: Constraint, tokenizer: Tokenizer):
    """The constraint compiled for this tokenizer and checked, as an llguidance.LLMatcher (give each row a
    Matcher of it). Raises AftgenError, in one line, for one that cannot be compiled, accepts no text or
    cannot take its first token. Can take seconds for a large schema, in which llguidance lets go of Python's
    lock: a server calls it on a thread of its own, before the request is admitted. Kept by its text."""
    key = (constraint, tokenizer)
    matcher = _kept.get(key)
    if matcher is None:
        import llguidance

        try:
            grammar = _grammar(constraint)
            matcher = llguidance.LLMatcher(_guidance_tokenizer(tokenizer), grammar, log_level=0, limits=_limits())
        except ValueError as exc:  # a schema that is not JSON, a grammar that is not GBNF
            raise AftgenError(f"the {constraint.kind} cannot be compiled: {one_line(str(exc))}") from None
        if matcher.is_error():
            raise AftgenError(f"the {constraint.kind} cannot be compiled: {one_line(matcher.get_error())}")
        _kept.put(key, _checked(constraint, matcher), len(grammar) * BYTES_PER_GRAMMAR_BYTE)
    return matcher


@functools.cache
def _limits():
    """llguidance's own limits, its errors without the parser's state (a server sends them to the client)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def _checked(constraint: Constraint, matcher):
    """`matcher`, once a copy has computed its first mask and taken the first token allowed: what fails there
    (no text accepted, a limit reached at once, as by a right-recursive rule) would fail every generation."""
    trial = matcher.deep_copy()
    allowed = trial.compute_bitmask()
    if not trial.is_error():
        trial.consume_token(first_set(allowed))
    if trial.is_error():
        error = trial.get_error()
        if error.startswith(NO_TEXT):
            raise AftgenError(f"the {constraint.kind} accepts no text: nothing can be generated that matches it")
        raise AftgenError(f"the {constraint.kind} cannot be followed: {one_line(error)}")
    return matcher


def first_set(bits: bytes) -> int:
    """The first token a mask (Matcher.allowed_bits) allows; a mask always allows one, EOS at least."""
    byte = next(i for i, value in enumerate(bits) if value)
    return byte * 8 + (bits[byte] & -bits[byte]).bit_length() - 1


def one_line(error: str) -> str:
    """llguidance's error in one line: its first, and the `error:` line under a quoted source if any."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    detail = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {detail}".strip() if lines else "unknown error"


class Matcher:
    """One row's place in its constraint: which tokens may come next, advanced by each token drawn."""

    def __init__(self, prototype):
        """`prototype`: the constraint as `compiled` gives it."""
        self.matcher = prototype.deep_copy()
        self.spent = 0.0  # seconds its masks took

    @property
    def finished(self) -> bool:
        """The text is complete: it is accepted and nothing more is allowed (or EOS was drawn)."""
        return self.matcher.is_stopped()

    def advance(self, token: int) -> None:
        """Take the token drawn; ConstraintBroken where llguidance cannot (its limits reached)."""
        if not self.matcher.consume_token(token):
            raise ConstraintBroken(f"the constraint broke at token {token}: {one_line(self.matcher.get_error())}")

    def allowed_bits(self) -> bytes:
        """One bit per token (little-endian within each 32-bit word): set where the token may come next.
        ConstraintBroken where llguidance cannot tell (its limits reached)."""
        start = time.perf_counter()
        bits = self.matcher.compute_bitmask()
        self.spent += time.perf_counter() - start
        if self.matcher.is_error():
            raise ConstraintBroken(f"the constraint broke: {one_line(self.matcher.get_error())}")
        return bits


def masked(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> torch.Tensor:
    """logits (B, V) with each constrained row's ruled-out tokens at -inf; rows whose matcher is None, and
    every row where none has one, are left exactly as they are. ConstraintBroken names the rows whose
    constraint broke (every mask is computed first)."""
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return logits
    masks, broken = [], {}
    for row in rows:
        try:
            masks.append(matchers[row].allowed_bits())
        except ConstraintBroken as exc:
            broken[row] = str(exc)
    if broken:
        raise ConstraintBroken(next(iter(broken.values())), broken)
    bits = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.uint8)
    unpacked = (bits.view(len(rows), -1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    vocab = logits.shape[-1]
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    allowed[rows] = False  # tokens past the tokenizer's (a model's padded vocabulary) are never allowed
    known = min(vocab, unpacked.shape[1] * 8)
    allowed[torch.tensor(rows), :known] = unpacked.view(len(rows), -1)[:, :known].bool()
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def json_source(schema: object) -> str:
    """A schema as the JSON text a Constraint holds: keys in the order given, as properties are written in it."""
    return json.dumps(schema, separators=(",", ":"))
