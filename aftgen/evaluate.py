"""Held-out loss, in units that compare across tokenizers: nats per token, per character, per byte."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from aftgen.errors import AftgenError
from aftgen.model import AFTLM
from aftgen.tokenizer import Tokenizer


@dataclass
class Evaluation:
    nats_per_token: float
    nats_per_char: float
    bits_per_char: float
    bits_per_byte: float
    tokens: int
    chars: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def stream_nll(model: AFTLM, ids: torch.Tensor, chunk: int = 1024, reset_every: int = 0) -> torch.Tensor:
    """Per-token negative log-likelihood of ids[1:] given everything before, read as one stream.

    The file is read chunk by chunk in the parallel form, carrying the recurrent state across
    chunks, so memory stays constant however long the file is. With `reset_every` > 0 the context
    is instead cut into independent windows of that many tokens (the way a model trained on
    fixed-length windows sees text).
    """
    ids = ids.long()
    predicted = len(ids) - 1
    window = reset_every or predicted
    losses = []
    for window_start in range(0, predicted, window):
        state = None
        window_stop = min(window_start + window, predicted)
        for start in range(window_start, window_stop, chunk):
            stop = min(start + chunk, window_stop)
            logits, state = model.prefill(ids[None, start:stop], state)
            targets = ids[start + 1 : stop + 1].to(logits.device)
            losses.append(F.cross_entropy(logits[0].float(), targets, reduction="none").cpu())
    return torch.cat(losses)


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
    if reset_every < 0:
        raise AftgenError(f"--reset-every must be >= 0, got {reset_every}")
    ids = torch.tensor([tokenizer.bos_id, *tokenizer.encode(text)])
    return summarise(stream_nll(model, ids, reset_every=reset_every), text)


def summarise(nll: torch.Tensor, text: str) -> Evaluation:
    total = float(nll.double().sum())
    chars, nbytes = len(text), len(text.encode("utf-8"))
    return Evaluation(
        nats_per_token=total / len(nll),
        nats_per_char=total / chars,
        bits_per_char=total / chars / math.log(2),
        bits_per_byte=total / nbytes / math.log(2),
        tokens=len(nll),
        chars=chars,
    )
