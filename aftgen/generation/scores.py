"""The scores records: a token's log-probability and its likeliest alternatives', packed where a step's logits are
(token_scores), carried to the HTTP side in aftgen.serve.work's TokenScores and read back where a reply is written
(read_scores, in aftgen.serve.replies)."""

from __future__ import annotations

import functools
import struct

import torch

from aftgen.native import top_scores


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each token's log-probability (T,) under its row of logits (T, V), float32: the model's distribution before
    any sampling filter, as OpenAI and vLLM report it. `aftgen eval` sums these, the server echoes them."""
    return chosen(logits.float().log_softmax(-1), tokens)


def chosen(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logprobs.gather(-1, tokens[:, None].to(logprobs.device))[:, 0]


def token_scores(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[tuple[int, str]]:
    """Each token's (id, scores record) under its row of logits (T, V): its log-probability (token_logprobs'
    figure) and the `top` likeliest tokens', likeliest first, packed for the trip to the replies (read_scores)."""
    count = min(top, logits.shape[-1])
    packed = top_scores.top_scores(logits, tokens, count) if logits.device.type == "cpu" else None
    if packed is None:  # a GPU's logits, no C++ compiler here, or more alternatives than the kernel keeps
        packed = top_scores_in_torch(logits.float().log_softmax(-1), tokens, count)
    # one call for the step, cut into rows: a call a row costs the engine twice that
    text = packed.numpy().astype("<i4", copy=False).tobytes().hex()
    width = 8 * packed.shape[1]
    return list(zip(tokens.tolist(), [text[at : at + width] for at in range(0, len(text), width)], strict=True))


def top_scores_in_torch(logprobs: torch.Tensor, tokens: torch.Tensor, count: int) -> torch.Tensor:
    """aftgen.native.top_scores's packing (T, 1 + 2 count) int32 on the CPU, from logprobs (T, V) on any device; among
    equal figures, in torch.topk's order (a stable sort, which would keep top_scores's, costs a CPU 30 times as
    much)."""
    best = logprobs.topk(count, -1)
    figures = torch.cat([chosen(logprobs, tokens)[:, None], best.values], 1)  # (T, 1 + count) float32
    return torch.cat([figures.view(torch.int32), best.indices.int()], 1).cpu()


# A scores record is the hex of little-endian float32 [the token's log-probability, the alternatives'] and int32
# [the alternatives' ids]: a server writes one a token from the engine's process and reads it in the HTTP one,
# where numbers (six floats and five ints for `logprobs: 5`, each a Python object made and encoded) cost the engine,
# which sets the pace, a tenth of its time; a record costs it one string. The HTTP side, with time to spare, reads them.
NO_SCORES = ""  # the record of a token nothing predicts (a context's first)


def read_scores(record: str, top: int) -> tuple[float | None, tuple[int, ...], tuple[float, ...]]:
    """A scores record's log-probability and its at most `top` likeliest tokens' (ids, log-probabilities),
    likeliest first; (None, (), ()) for NO_SCORES."""
    if record == NO_SCORES:
        return None, (), ()
    count = (len(record) // 8 - 1) // 2
    numbers = _record_layout(count).unpack(bytes.fromhex(record))
    return numbers[0], numbers[1 + count : 1 + count + top], numbers[1 : 1 + min(count, top)]


@functools.cache
def _record_layout(count: int) -> struct.Struct:
    return struct.Struct(f"<{1 + count}f{count}i")
