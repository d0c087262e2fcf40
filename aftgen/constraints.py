"""Structured output: text that follows a JSON schema, a regular expression, a grammar or a list of choices.

llguidance (the Rust library behind guidance, also in vLLM and llama.cpp) compiles a constraint against the
tokenizer's pieces and gives, before each token, the set of tokens that keep the text a prefix of something
the constraint accepts. The rows that draw (sampling.next_tokens) mask their logits with it: a row without a
constraint is left as it is, so it draws what it would draw alone. A constraint is complete when it accepts
and allows nothing more: its row stops there (finish_reason "stop"); one cut short by the token limit ends
with "length", as OpenAI's API does.
"""

from __future__ import annotations

import functools
import json
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
COMPILED_KEPT = 64  # compiled constraints kept, by their text: a client sends the same schema again and again


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


@functools.lru_cache(maxsize=COMPILED_KEPT)
def compiled(constraint: Constraint, tokenizer: Tokenizer):
    """The constraint compiled for this tokenizer, as a fresh llguidance.LLMatcher (copy it before use).
    Raises AftgenError, in one line, for a constraint that cannot be compiled. Can take a while for a
    large schema: a server calls it off its event loop."""
    import llguidance

    try:
        matcher = llguidance.LLMatcher(_guidance_tokenizer(tokenizer), _grammar(constraint), log_level=0)
    except ValueError as exc:  # a schema that is not JSON, a grammar that is not GBNF
        raise AftgenError(f"the {constraint.kind} cannot be compiled: {one_line(str(exc))}") from None
    if matcher.is_error():
        raise AftgenError(f"the {constraint.kind} cannot be compiled: {one_line(matcher.get_error())}")
    return matcher


def one_line(error: str) -> str:
    """llguidance's error in one line: its first, and the `error:` line under a quoted source if any."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    detail = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {detail}".strip() if lines else "unknown error"


class Matcher:
    """One row's place in its constraint: which tokens may come next, advanced by each token drawn."""

    def __init__(self, constraint: Constraint, tokenizer: Tokenizer):
        self.matcher = compiled(constraint, tokenizer).deep_copy()

    @property
    def finished(self) -> bool:
        """The text is complete: it is accepted and nothing more is allowed (or EOS was drawn)."""
        return self.matcher.is_stopped()

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):  # the mask allowed it: only a bug in the mask gets here
            raise AftgenError(f"token {token} broke the constraint: {one_line(self.matcher.get_error())}")

    def allowed_bits(self) -> bytes:
        """One bit per token (little-endian within each 32-bit word): set where the token may come next."""
        return self.matcher.compute_bitmask()


def masked(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> torch.Tensor:
    """logits (B, V) with each constrained row's ruled-out tokens at -inf; rows whose matcher is None, and
    every row where none has one, are left exactly as they are."""
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return logits
    bits = torch.frombuffer(bytearray(b"".join(matchers[row].allowed_bits() for row in rows)), dtype=torch.uint8)
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
