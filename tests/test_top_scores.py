"""rowdot.top_scores, the serving step's scores for `logprobs`: the same figures and ids as torch.topk, the lower
id first among equal figures, arguments out of range refused before anything is read, and torch's path where the
library cannot be built (asked once, not at every step)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.exc import InvalidCxxCompiler

from aftgen import rowdot
from aftgen.compiled_cache import CacheUnusable
from aftgen.sampling import read_score, token_scores, top_scores_in_torch


def logprobs_without_ties(rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 3
    logits[torch.rand(rows, vocab, generator=generator) < 0.2] = float("-inf")  # masked, as a constraint masks
    logits[:, 0] = 0.0  # a finite one in every row
    return logits.log_softmax(-1).float()


@pytest.mark.parametrize(("vocab", "k"), [(1024, 5), (1024, 1), (1024, 0), (1024, 20), (300, 20), (20, 20), (7, 3)])
def test_the_figures_and_ids_are_torch_topks(vocab, k):
    for seed in range(20):
        logprobs = logprobs_without_ties(32, vocab, seed)
        tokens = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(seed))
        ours, torchs = rowdot.top_scores(logprobs, tokens, k), top_scores_in_torch(logprobs, tokens, k)
        assert torch.equal(ours[:, : 1 + k], torchs[:, : 1 + k])  # the figures, bit for bit
        finite = ours[:, 1 : 1 + k].view(torch.float32).isfinite()  # masked ones tie at -inf, in any order
        assert torch.equal(ours[:, 1 + k :][finite], torchs[:, 1 + k :][finite])


def test_among_equal_figures_the_lower_id_comes_first():
    logprobs = torch.full((3, 40), -3.0)
    logprobs[1, [7, 30, 12]] = -1.0  # three equal leaders, found out of order
    logprobs[2, 39] = float("-inf")
    packed = rowdot.top_scores(logprobs, torch.tensor([0, 12, 39]), 5)
    ids = packed[:, 6:].tolist()
    assert ids == [[0, 1, 2, 3, 4], [7, 12, 30, 0, 1], [0, 1, 2, 3, 4]]
    chosen = packed[:, 0].view(torch.float32).tolist()
    assert chosen == [-3.0, -1.0, float("-inf")]


@pytest.mark.parametrize("token", [40, -1, 2**40])
def test_a_token_out_of_range_is_refused_not_read(token):
    with pytest.raises(ValueError, match="a token is out of range"):
        rowdot.top_scores(torch.zeros(2, 40), torch.tensor([0, token]), 5)


@pytest.mark.parametrize("k", [-1, 41, -(2**32) + 5, 2**32 + 5])  # the last two: what a C int would wrap to 5
def test_a_k_out_of_range_is_refused_before_anything_is_made(k):
    with pytest.raises(ValueError, match=f"and k={k}$"):
        rowdot.top_scores(torch.zeros(2, 40), torch.tensor([0, 1]), k)


def test_more_alternatives_than_the_kernel_keeps_are_torchs():
    logprobs = logprobs_without_ties(2, 100, seed=3)
    tokens = torch.tensor([4, 99])
    most = rowdot.scores_library().aftgen_top_scores_most()
    assert rowdot.top_scores(logprobs, tokens, most) is not None
    assert rowdot.top_scores(logprobs, tokens, most + 1) is None
    records = token_scores(logprobs, tokens, most + 1)
    assert [len(read_score(record, most + 1)[1]) for _, record in records] == [most + 1] * 2


@pytest.mark.parametrize(
    ("logprobs", "tokens"),
    [(torch.zeros(2, 40), torch.tensor([0, 1, 2])), (torch.zeros(2, 40), torch.tensor([[0, 1]])),
     (torch.zeros(40), torch.tensor([0])), (torch.zeros(2, 40, device="meta"), torch.tensor([0, 1]))],
)  # fmt: skip
def test_shapes_or_a_device_the_kernel_cannot_read_are_refused_not_read(logprobs, tokens):
    with pytest.raises(ValueError, match="top_scores reads logprobs"):
        rowdot.top_scores(logprobs, tokens, 3)


@pytest.mark.parametrize(
    "failure",
    [rowdot.RowdotUnavailable("cannot build the batch-invariant product: g++ said: no"),
     InvalidCxxCompiler(),  # what torch raises where it finds no compiler at all
     CacheUnusable("/cache/compiled is not a folder"), OSError("cannot open shared object file")],
)  # fmt: skip
def test_without_the_library_the_records_are_torchs_and_the_build_is_tried_once(failure, monkeypatch):
    logprobs = logprobs_without_ties(8, 256, seed=1)
    tokens = torch.arange(8) * 30
    with_library = token_scores(logprobs, tokens, 5)
    builds = []

    def failing_library():
        builds.append(1)
        raise failure

    monkeypatch.setattr(rowdot, "library", failing_library)
    rowdot.scores_library.cache_clear()
    try:
        assert token_scores(logprobs, tokens, 5) == token_scores(logprobs, tokens, 5) == with_library
        assert builds == [1]
    finally:
        rowdot.scores_library.cache_clear()
    logprob, ids, values = read_score(with_library[2][1], 5)
    assert logprob == pytest.approx(logprobs[2, 60].item()) and ids == tuple(logprobs[2].topk(5).indices.tolist())
    assert values == pytest.approx(logprobs[2].topk(5).values.tolist())
