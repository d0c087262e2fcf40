"""A step's scores for `logprobs` in one call to the native library (top_scores.cpp says how): each row's chosen
token's log-probability and its k likeliest tokens', packed as aftgen.generation.scores' records are.
"""

from __future__ import annotations

import torch

from aftgen.native.library import usable_library


def top_scores(logits: torch.Tensor, tokens: torch.Tensor, k: int, level: int | None = None) -> torch.Tensor | None:
    """Each row of `logits` (T, V) on a CPU, made log-probabilities (log_softmax): the log-probability of its token in
    `tokens` (T,) and the `k` largest, high to low (the lower id first among equal logits), packed as int32
    (T, 1 + 2k): [the token's figure, the k figures (float32 bits), their ids]. None where the library cannot serve
    it: it cannot be built here, or k is above the most it keeps. `level`: the kernel compiled for which level of
    the machine (0 to scores_levels() - 1; None: the highest, as the server runs), for tests."""
    on_cpu = logits.device.type == tokens.device.type == "cpu"
    shapes = logits.dim() == 2 and logits.shape[1] > 0 and tokens.shape == logits.shape[:1]
    if not (shapes and on_cpu and 0 <= k <= logits.shape[1]):
        raise ValueError(
            f"top_scores reads logits (T, V > 0) and tokens (T,) on a CPU and 0 <= k <= V, not {logits.shape} on "
            f"{logits.device}, {tokens.shape} on {tokens.device} and k={k}"
        )
    loaded = usable_library()
    if loaded is None or k > loaded.top_scores_most:
        return None
    levels = loaded.top_scores_levels
    level = levels - 1 if level is None else level
    if not 0 <= level < levels:
        raise ValueError(f"top_scores: this machine runs levels 0 to {levels - 1} of the kernel, not {level}")
    logits, tokens = logits.float().contiguous(), tokens.long().contiguous()
    packed = torch.empty(logits.shape[0], 1 + 2 * k, dtype=torch.int32)
    failed = loaded.aftgen_top_scores(level, logits.data_ptr(), logits.shape[0], logits.shape[1], tokens.data_ptr(),
                                      k, packed.data_ptr())  # fmt: skip
    if failed:
        raise ValueError(f"top_scores: a token is out of range for a vocabulary of {logits.shape[1]}")
    return packed


def scores_levels() -> int:
    """How many levels of top_scores's kernel this machine runs (base; x86-64-v3; v4), 0 without the library."""
    loaded = usable_library()
    return 0 if loaded is None else loaded.top_scores_levels
