"""Drawing a batch's next tokens: each row with its own controls, history and generator draws what it draws
alone; a greedy row draws nothing; rows whose scores are not finite are refused by name."""

from __future__ import annotations

import random

import pytest
import torch

from aftgen.generation.controls import GREEDY_BELOW, SamplingOptions
from aftgen.generation.drawing import ScoresNotFinite, choose, draw


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-39, GREEDY_BELOW / 2])
def test_a_temperature_below_the_smallest_that_matters_is_greedy(temperature):
    """With or without a repeat penalty (at its smallest too), whatever the scores' scale."""
    torch.manual_seed(0)
    logits, history = torch.randn(16, 50) * 30, torch.randint(0, 50, (16, 8))
    for penalty in (1.0, 1.3, 1e-4):
        options = SamplingOptions(temperature=temperature, repeat_penalty=penalty)
        greedy = choose(logits, SamplingOptions(temperature=0, repeat_penalty=penalty), history, torch.Generator())
        assert torch.equal(choose(logits, options, history, torch.Generator()), greedy)


def test_rows_whose_scores_are_not_finite_are_refused_by_name_before_anything_is_drawn():
    logits = torch.randn(5, 10)
    logits[0, :4] = float("-inf")  # ruled out tokens: the row still draws
    logits[1, 3], logits[2, 0], logits[3] = float("nan"), float("inf"), float("-inf")
    generators = [torch.Generator().manual_seed(i) for i in range(5)]
    before = [generator.get_state() for generator in generators]
    for options in (SamplingOptions(temperature=1.0), SamplingOptions(temperature=0)):
        with pytest.raises(ScoresNotFinite) as refused:
            choose(logits, options, torch.zeros(5, 0, dtype=torch.long), generators)
        assert refused.value.rows == [1, 2, 3] and "NaN or infinite" in str(refused.value)
    assert all(torch.equal(g.get_state(), state) for g, state in zip(generators, before, strict=True))
    first = choose(logits[:1], SamplingOptions(temperature=1.0), torch.zeros(1, 0, dtype=torch.long), generators[:1])
    assert int(first) >= 4  # never a ruled-out token


def test_draw_follows_each_rows_probabilities_from_its_own_generator():
    """Rows drawn together draw what each draws alone, draw for draw; a token is drawn as often as its
    probability says (within 5 standard deviations over 4000 draws), one with none never."""
    probs = torch.tensor([[0.5, 0.3, 0.0, 0.15, 0.05], [0.0, 0.0, 1.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    alone = [torch.Generator().manual_seed(seed) for seed in range(3)]
    together = [torch.Generator().manual_seed(seed) for seed in range(3)]
    counts = torch.zeros_like(probs)
    for _ in range(4000):
        drawn = draw(probs, together)
        assert drawn.tolist() == [int(draw(probs[i : i + 1], [alone[i]])) for i in range(3)]
        counts[torch.arange(3), drawn] += 1
    spread = (probs * (1 - probs) * 4000).sqrt()
    assert ((counts - probs * 4000).abs() <= 5 * spread).all() and counts[probs == 0].sum() == 0


def test_rows_with_their_own_settings_draw_together_what_each_draws_alone():
    """One pass for 32 rows, each with its own controls (some at their neutral values, some greedy), its own
    history and seed, three tokens running: each row draws what it draws alone, and its generator ends
    where it would alone (a greedy row's does not move)."""
    torch.manual_seed(0)
    pick = random.Random(0)
    logits, history = torch.randn(32, 50) * 3, torch.randint(0, 50, (32, 12))
    rows = [
        SamplingOptions(
            temperature=pick.choice([0.0, GREEDY_BELOW / 2, 0.3, 0.8, 1.5]),
            top_k=pick.choice([0, 1, 5, 50, 1 << 64]),
            top_p=pick.choice([1.0, 0.9, 0.3, 1e-300]),
            min_p=pick.choice([0.0, 0.05, 0.5]),
            repeat_penalty=pick.choice([1.0, 1.3, 0.5, 1e-4]),
            repeat_last_n=pick.choice([0, 3, 64]),
        )
        for _ in range(32)
    ]
    alone = [torch.Generator().manual_seed(seed) for seed in range(32)]
    together = [torch.Generator().manual_seed(seed) for seed in range(32)]
    for _ in range(3):
        singles = [int(choose(logits[i : i + 1], rows[i], history[i : i + 1], alone[i])) for i in range(len(rows))]
        assert choose(logits, rows, history, together).tolist() == singles
        logits = logits.roll(1, dims=-1)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(alone, together, strict=True))
    greedy = [i for i, row in enumerate(rows) if row.temperature < GREEDY_BELOW]
    assert greedy and all(
        torch.equal(together[i].get_state(), torch.Generator().manual_seed(i).get_state()) for i in greedy
    )
