"""aftgen.native.top_scores, the serving step's scores for `logprobs` from its logits: torch's log_softmax figures and
torch.topk's ids at every level of the kernel this machine runs, the lower id first among equal logits, arguments
out of range refused before anything is read, and torch's path where the library cannot be built (asked once, not
at every step)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.exc import InvalidCxxCompiler

from aftgen.compiled.cache import CacheUnusable
from aftgen.generation.scores import read_scores, token_scores
from aftgen.native import library, top_scores

LEVELS = range(top_scores.scores_levels())


def logits_without_ties(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * scale
    logits[torch.rand(rows, vocab, generator=generator) < 0.2] = float("-inf")  # masked, as a constraint masks
    logits[:, 0] = 0.0  # a finite one in every row
    return logits.float()


def assert_torchs(ours: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> None:
    """Figures within float32's rounding of log_softmax's in float64, and torch.topk's ids where figures are finite."""
    exact = logits.double().log_softmax(-1)
    best = exact.topk(k, -1)
    figures = ours[:, : 1 + k].view(torch.float32).double()
    torch.testing.assert_close(figures, torch.cat([exact.gather(1, tokens[:, None]), best.values], 1), rtol=1e-6,
                               atol=2e-6)  # fmt: skip
    finite = figures[:, 1:].isfinite()  # masked ones tie at -inf, in any order
    assert torch.equal(ours[:, 1 + k :][finite], best.indices.int()[finite])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("vocab", "k"), [(1024, 5), (1024, 1), (1024, 0), (1024, 20), (300, 20), (20, 20), (7, 3),
                                          (1000, 64)])  # fmt: skip
def test_the_figures_are_log_softmaxs_and_the_ids_torch_topks(vocab, k, level):
    for seed in range(20):
        logits = logits_without_ties(32, vocab, seed)
        tokens = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(seed))
        assert_torchs(top_scores.top_scores(logits, tokens, k, level), logits, tokens, k)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("scale", [1e-3, 30.0, 1e4])  # near-uniform rows; one token taking all; exp's floor
def test_the_log_sum_exp_holds_over_the_whole_range(scale, level):
    logits = logits_without_ties(16, 777, seed=5, scale=scale) + 50.0
    tokens = torch.arange(16) * 40
    assert_torchs(top_scores.top_scores(logits, tokens, 5, level), logits, tokens, 5)


def test_among_equal_logits_the_lower_id_comes_first():
    logits = torch.full((3, 40), -3.0)
    logits[1, [7, 30, 12]] = -1.0  # three equal leaders, found out of order
    logits[2, 39] = float("-inf")
    packed = top_scores.top_scores(logits, torch.tensor([0, 12, 39]), 5)
    ids = packed[:, 6:].tolist()
    assert ids == [[0, 1, 2, 3, 4], [7, 12, 30, 0, 1], [0, 1, 2, 3, 4]]
    chosen = packed[:, 0].view(torch.float32)
    assert torch.allclose(chosen, logits.log_softmax(-1)[[0, 1, 2], [0, 12, 39]])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("vocab", [65, 129, 1025])
def test_ties_across_groups_come_lower_id_first_as_a_stable_sort_puts_them(vocab, level):
    """Past 64 logits, a group holds several ids and the groups that reach the bound are read in their order, not
    the ids': equal logits must still come lower id first, for every k up to all of the row."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-3, 1, (6, vocab), generator=generator).float()  # four values: ties everywhere
    logits[0] = 0.0  # all equal
    logits[1, [1, vocab - 1, 64]] = 5.0  # leaders in three groups, the group of the highest id read first
    tokens = torch.zeros(6, dtype=torch.long)
    stable = logits.sort(dim=-1, descending=True, stable=True).indices
    for k in sorted({1, 3, 5, 20, min(vocab, 64)}):
        ids = top_scores.top_scores(logits, tokens, k, level)[:, 1 + k :]
        assert torch.equal(ids, stable[:, :k].int()), k


@pytest.mark.parametrize("token", [40, -1, 2**40])
def test_a_token_out_of_range_is_refused_not_read(token):
    with pytest.raises(ValueError, match="a token is out of range"):
        top_scores.top_scores(torch.zeros(2, 40), torch.tensor([0, token]), 5)


@pytest.mark.parametrize("k", [-1, 41, -(2**32) + 5, 2**32 + 5])  # the last two: what a C int would wrap to 5
def test_a_k_out_of_range_is_refused_before_anything_is_made(k):
    with pytest.raises(ValueError, match=f"and k={k}$"):
        top_scores.top_scores(torch.zeros(2, 40), torch.tensor([0, 1]), k)


@pytest.mark.parametrize("level", [-1, 3, 2**32 + 1])
def test_a_level_this_machine_cannot_run_is_refused(level):
    if 0 <= level < top_scores.scores_levels():
        pytest.skip("this machine runs that level")
    with pytest.raises(ValueError, match="levels 0 to"):
        top_scores.top_scores(torch.zeros(2, 40), torch.tensor([0, 1]), 5, level)


def test_more_alternatives_than_the_kernel_keeps_are_torchs():
    logits = logits_without_ties(2, 100, seed=3)
    tokens = torch.tensor([4, 99])
    most = library.usable_library().top_scores_most
    assert top_scores.top_scores(logits, tokens, most) is not None
    assert top_scores.top_scores(logits, tokens, most + 1) is None
    records = token_scores(logits, tokens, most + 1)
    assert [len(read_scores(record, most + 1)[1]) for _, record in records] == [most + 1] * 2


@pytest.mark.parametrize(
    ("logits", "tokens"),
    [(torch.zeros(2, 40), torch.tensor([0, 1, 2])), (torch.zeros(2, 40), torch.tensor([[0, 1]])),
     (torch.zeros(40), torch.tensor([0])), (torch.zeros(2, 40, device="meta"), torch.tensor([0, 1])),
     (torch.zeros(2, 0), torch.tensor([0, 0]))],
)  # fmt: skip
def test_shapes_or_a_device_the_kernel_cannot_read_are_refused_not_read(logits, tokens):
    with pytest.raises(ValueError, match="top_scores reads logits"):
        top_scores.top_scores(logits, tokens, 0)


def records(scored: list[tuple[int, str]]) -> list[tuple]:
    return [(token, *read_scores(record, 5)) for token, record in scored]


@pytest.mark.parametrize(
    "failure",
    [library.NativeUnavailable("cannot build the native library: g++ said: no"),
     InvalidCxxCompiler(),  # what torch raises where it finds no compiler at all
     CacheUnusable("/cache/compiled is not a folder"), OSError("cannot open shared object file")],
)  # fmt: skip
def test_without_the_library_the_records_are_torchs_and_the_build_is_tried_once(failure, monkeypatch, capsys):
    logits = logits_without_ties(8, 256, seed=1)
    tokens = torch.arange(8) * 30
    with_library = records(token_scores(logits, tokens, 5))
    builds = []

    def failing_library():
        builds.append(1)
        raise failure

    monkeypatch.setattr(library, "library", failing_library)
    library.decided.cache_clear()
    try:
        first, second = records(token_scores(logits, tokens, 5)), records(token_scores(logits, tokens, 5))
        assert builds == [1] and first == second
    finally:
        library.decided.cache_clear()
    said = capsys.readouterr().err.splitlines()  # why, once
    assert len(said) == 1 and said[0].endswith(library.WITHOUT), said
    for ours, torchs in zip(with_library, first, strict=True):
        assert ours[:3:2] == torchs[:3:2]  # the token and its alternatives' ids
        assert ours[1] == pytest.approx(torchs[1]) and ours[3] == pytest.approx(torchs[3])
    logprobs = logits.log_softmax(-1)
    token, logprob, ids, values = with_library[2]
    assert logprob == pytest.approx(logprobs[2, 60].item()) and ids == tuple(logprobs[2].topk(5).indices.tolist())
    assert values == pytest.approx(logprobs[2].topk(5).values.tolist())
