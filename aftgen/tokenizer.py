"""SentencePiece tokenizer with byte fallback and no normalisation: decode(encode(text)) == text.

SentencePiece writes spaces as the meta symbol U+2581, so a literal U+2581 in the text would come
back as a space. We escape it (and our escape character) before encoding, which keeps the round
trip exact for any Unicode text.
"""

from __future__ import annotations

import codecs
import functools
import io
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from aftgen.errors import AftgenError
from aftgen.files import read_bytes

TOKENIZER_TYPES = ("bpe", "unigram", "char")
TOKENIZER_LIMIT = 256 << 20  # bytes: a SentencePiece model of a million pieces is tens of MB
_ESCAPE = "\ue000"  # private-use code point: ESC ESC is a literal ESC, ESC + "s" a literal U+2581
_META = "\u2581"
_UNESCAPE = re.compile(_ESCAPE + "(.)", re.DOTALL)
_TOO_HIGH = re.compile(r"value <= (\d+)")
_TOO_LOW = re.compile(r"smaller than required_chars\. \d+ vs (\d+)")
TRAINER_SLICE = 4096  # characters per sentence the trainer reads


def _escape(text: str) -> str:
    return text.replace(_ESCAPE, _ESCAPE + _ESCAPE).replace(_META, _ESCAPE + "s")


def _unescape(text: str) -> str:
    return _UNESCAPE.sub(lambda m: _ESCAPE if m.group(1) == _ESCAPE else _META, text)


def valid_text(text: str, source: str) -> str:
    """`text`, refused (naming `source`) if it holds bytes that were not UTF-8: Python decodes the command
    line (and stdin, as aftgen reads it) keeping such bytes as lone surrogates (PEP 383), which no
    tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise AftgenError(
            f"{source} is not valid UTF-8 (an undecodable byte at character {exc.start}); give UTF-8 text"
        ) from None
    return text


class Tokenizer:
    """Text <-> token ids, plus a streaming decoder for generation."""

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model_proto)
            # A damaged file can load and still hold pieces that are not UTF-8 or bad byte pieces.
            self._piece_bytes = [self._bytes_of(i) for i in range(self.sp.get_piece_size())]
        except Exception as exc:  # sentencepiece raises plain RuntimeError/OSError/UnicodeDecodeError
            raise AftgenError(f"tokenizer.model is not a valid SentencePiece model ({exc})") from None
        if self.bos_id < 0:  # every sequence starts with BOS; aftgen's tokenizers always have one
            raise AftgenError("tokenizer.model has no BOS piece, so it was not made by aftgen")

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        return cls(read_bytes(path, TOKENIZER_LIMIT, "the tokenizer"))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def longest_piece(self) -> int:
        """The most UTF-8 bytes one token stands for: a text of N bytes is at least N / this many tokens."""
        return max(1, max(map(len, self._piece_bytes)))

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(_escape(text))

    def encode_many(self, texts: list[str], threads: int = 1) -> list[list[int]]:
        """encode() of each text, on `threads` threads."""
        return self.sp.encode([_escape(text) for text in texts], num_threads=threads)

    def decode(self, ids: Iterable[int]) -> str:
        return _unescape(self.sp.decode(list(ids)))

    def _bytes_of(self, token: int) -> bytes:
        if self.sp.is_byte(token):
            return bytes([int(self.sp.id_to_piece(token)[1:-1], 16)])  # "<0xAB>"
        if self.sp.is_control(token) or self.sp.is_unknown(token):
            return b""
        return self.sp.id_to_piece(token).replace(_META, " ").encode("utf-8")

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes a token stands for (a byte-fallback piece: one byte, maybe part of a character)."""
        return self._piece_bytes[token]

    def token_text(self, token: int) -> str:
        """A token as OpenAI-compatible servers name it in log-probabilities: its text, or where its bytes are not
        UTF-8 alone (a byte-fallback piece, part of a character) "bytes:" and their escapes, as vLLM writes them."""
        return self._token_names[token]

    @functools.cached_property
    def _token_names(self) -> list[str]:
        """Every token's name, made once: a server names six tokens a token with `logprobs: 5`."""
        return [_name(data) for data in self._piece_bytes]

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns tokens into text as they arrive, only ever emitting whole characters."""

    def __init__(self, tokenizer: Tokenizer):
        self._piece_bytes = tokenizer._piece_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending_escape = ""

    def feed(self, token: int) -> str:
        return self.feed_bytes(self._piece_bytes[token])

    def feed_bytes(self, data: bytes) -> str:
        return self._unescape(self._utf8.decode(data))

    def pending(self) -> bytes:
        """What was fed but not emitted yet (the start of an unfinished character), as UTF-8 bytes.

        A fresh decoder fed these bytes is in the same state as this one, so a stream can be saved and resumed.
        """
        return self._pending_escape.encode("utf-8") + self._utf8.getstate()[0]

    def flush(self) -> str:
        return self._unescape(self._utf8.decode(b"", final=True)) + self._pending_escape

    def _unescape(self, text: str) -> str:
        text = self._pending_escape + text
        if _ESCAPE not in text:  # nearly every token: no regular expression to run
            self._pending_escape = ""
            return text
        self._pending_escape = _ESCAPE if _ESCAPE_OPEN.search(text) else ""
        return _unescape(text[: len(text) - len(self._pending_escape)])


_ESCAPE_OPEN = re.compile(f"(?<!{_ESCAPE})(?:{_ESCAPE}{_ESCAPE})*{_ESCAPE}$")


def train_tokenizer(text: str, vocab_size: int, kind: str = "bpe", log=print) -> Tokenizer:
    """Train a SentencePiece model on `text`; a vocabulary too big for the text is clamped, with a message."""
    return train_tokenizer_on_slices(list(trainer_slices([text])), vocab_size, kind, log)


def train_tokenizer_on_slices(slices: Sequence[str], vocab_size: int, kind: str = "bpe", log=print) -> Tokenizer:
    """Train a SentencePiece model on `slices` (from `trainer_slices`); a vocabulary too big is clamped."""
    if kind not in TOKENIZER_TYPES:
        raise AftgenError(f"unknown tokenizer type '{kind}'; choose one of: {', '.join(TOKENIZER_TYPES)}")
    if vocab_size < 260 and kind != "char":
        raise AftgenError(f"--vocab-size must be at least 260 (256 byte pieces + specials), got {vocab_size}")
    for _ in range(3):
        proto = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(slices),
                model_writer=proto,
                model_type=kind,
                vocab_size=vocab_size,
                hard_vocab_limit=kind != "char",  # a char model's size is set by the text
                byte_fallback=True,
                normalization_rule_name="identity",
                add_dummy_prefix=False,
                remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True,
                split_digits=True,
                character_coverage=1.0,
                max_sentence_length=1 << 16,
                num_threads=2,
                minloglevel=2,
            )
        except RuntimeError as exc:
            too_high, too_low = _TOO_HIGH.search(str(exc)), _TOO_LOW.search(str(exc))
            if too_high:
                smaller = int(too_high.group(1))
                if smaller < 260:
                    raise AftgenError("the corpus is too small to train a tokenizer; give it more text") from None
                log(f"vocabulary size {vocab_size} is too large for this corpus; using {smaller}")
                vocab_size = smaller
            elif too_low:
                larger = int(too_low.group(1))
                log(f"vocabulary size {vocab_size} cannot hold every character of this corpus; using {larger}")
                vocab_size = larger
            else:
                raise AftgenError(f"tokenizer training failed: {exc}") from None
            continue
        return Tokenizer(proto.getvalue())
    raise AftgenError("tokenizer training failed")


def trainer_slices(texts: Iterable[str], size: int = TRAINER_SLICE) -> Iterator[str]:
    """The trainer's input for one document given in parts: its escaped text in slices of `size` characters
    (newlines kept inside, so pieces may span them)."""
    rest = ""
    for text in texts:
        rest += _escape(text)
        whole = len(rest) - len(rest) % size
        for start in range(0, whole, size):
            yield rest[start : start + size]
        rest = rest[whole:]
    if rest:
        yield rest


def _name(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)
