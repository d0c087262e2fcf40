"""Held-out loss, in units that compare across tokenizers: nats per token, per character, per byte."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from aftgen import cores
from aftgen.corpus.encode import WordEncoder, chunks
from aftgen.corpus.sources import Document, read_document
from aftgen.device import release_freed_memory
from aftgen.errors import AftgenError
from aftgen.generation.scores import token_logprobs
from aftgen.model import AFTLM
from aftgen.tokenizer import Tokenizer

PIECE_TOKENS = 1 << 20  # token ids read from a (memory-mapped) file at a time
CHUNK_CHARS = 1_000_000  # characters of a text file encoded at a time


@dataclass
class Evaluation:
    nats_per_token: float
    nats_per_char: float
    bits_per_char: float
    bits_per_byte: float
    tokens: int
    chars: int

    @classmethod
    def of(cls, nats: float, tokens: int, chars: int, nbytes: int) -> Evaluation:
        """From the summed loss of `tokens` predicted tokens over text of `chars` characters and `nbytes` bytes."""
        return cls(
            nats_per_token=nats / tokens,
            nats_per_char=nats / chars,
            bits_per_char=nats / chars / math.log(2),
            bits_per_byte=nats / nbytes / math.log(2),
            tokens=tokens,
            chars=chars,
        )

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def score_stream(
    model: AFTLM, pieces: Iterable[torch.Tensor], chunk: int = 1024, reset_every: int = 0
) -> Iterator[torch.Tensor]:
    """Per-token negative log-likelihood of a token stream given in pieces, each token given everything
    before it, yielded a chunk at a time.

    The stream is read chunk by chunk in the parallel form, carrying the recurrent state across
    chunks, so memory stays constant however long it is. With `reset_every` > 0 the context is
    instead cut into independent windows of that many tokens (the way a model trained on
    fixed-length windows sees text).
    """
    state, position, buffer = None, 0, torch.empty(0, dtype=torch.long)
    for piece in itertools.chain(pieces, [None]):
        if piece is not None:
            buffer = torch.cat([buffer, piece.long()])
        while len(buffer) > 1:
            if reset_every and position % reset_every == 0:
                state = None
            count = min(chunk, reset_every - position % reset_every) if reset_every else chunk
            if len(buffer) <= count and piece is not None:
                break  # wait for the rest of the chunk
            count = min(count, len(buffer) - 1)
            logits, state = model.prefill(buffer[None, :count], state)
            targets = buffer[1 : count + 1].to(logits.device)
            yield -token_logprobs(logits[0], targets).cpu()  # the server's echo reports the same figures
            cores.adapt()
            buffer, position = buffer[count:], position + count


def stream_nll(model: AFTLM, ids: torch.Tensor, chunk: int = 1024, reset_every: int = 0) -> torch.Tensor:
    """Per-token negative log-likelihood of ids[1:] given everything before, read as one stream."""
    return torch.cat(list(score_stream(model, [ids], chunk, reset_every)))


def evaluate_ids(model: AFTLM, ids: torch.Tensor, chars: int, nbytes: int, reset_every: int = 0) -> Evaluation:
    """Loss over token ids (a memory-mapped file's too: read a piece at a time) that encode `chars`
    characters, `nbytes` bytes of UTF-8."""
    return _evaluate(model, ids.split(PIECE_TOKENS), chars, nbytes, reset_every)


def _evaluate(model: AFTLM, pieces: Iterable[torch.Tensor], chars: int, nbytes: int, reset_every: int) -> Evaluation:
    if reset_every < 0:
        raise AftgenError(f"--reset-every must be >= 0, got {reset_every}")
    nats, tokens = 0.0, 0
    for losses in score_stream(model, pieces, reset_every=reset_every):
        nats, tokens = nats + float(losses.double().sum()), tokens + len(losses)
        if not math.isfinite(nats):
            raise AftgenError(
                f"the model's loss is NaN or infinite by token {tokens:,}: its weights are damaged "
                "(use another checkpoint)"
            )
    return Evaluation.of(nats, tokens, chars, nbytes)


@torch.inference_mode()
def window_loss(model: AFTLM, ids: torch.Tensor, length: int, windows: int) -> float:
    """Mean nats per token over up to `windows` evenly spaced windows of `length` tokens of ids (quick,
    deterministic: training's held-out check)."""
    count = max(1, min(windows, (len(ids) - 1) // length))
    stride = max(1, (len(ids) - length - 1) // count)
    rows = torch.stack([ids[i * stride : i * stride + length + 1] for i in range(count)]).long()
    rows = rows.to(model.embed.weight.device)
    was_training = model.training
    model.eval()
    total = 0.0
    for group in rows.split(32):  # bounded memory however many windows are asked for
        logits = model(group[:, :-1])
        total += float(F.cross_entropy(logits.flatten(0, 1), group[:, 1:].flatten(), reduction="sum"))
    model.train(was_training)
    return total / (count * length)


def evaluate_text(model: AFTLM, tokenizer: Tokenizer, text: str, reset_every: int = 0) -> Evaluation:
    """Loss over all of `text` (each token predicted from a BOS and the text before it)."""
    ids = torch.tensor([tokenizer.bos_id, *tokenizer.encode(text)])
    return evaluate_ids(model, ids, len(text), len(text.encode("utf-8")), reset_every)


def evaluate_file(
    model: AFTLM,
    tokenizer: Tokenizer,
    document: Document,
    encoding: str = "utf-8",
    errors: str = "strict",
    reset_every: int = 0,
) -> Evaluation:
    """evaluate_text of a file of any size (scanned by `scan_file`), read and encoded a chunk at a time:
    constant memory."""

    def pieces() -> Iterator[torch.Tensor]:
        encode = WordEncoder(tokenizer, np.dtype(np.int64))
        yield torch.tensor([tokenizer.bos_id])
        for chunk in chunks(read_document(document, encoding, errors), CHUNK_CHARS):
            yield torch.from_numpy(encode(chunk).copy())  # a writable copy: torch wants one
            release_freed_memory()  # megabyte-sized buffers fragment the heap, which would grow with the file

    return _evaluate(model, pieces(), document.chars, document.nbytes, reset_every)
