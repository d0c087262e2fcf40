"""The recipe's choice of vocabulary (issue 49): the rule on measured candidates, what keeps the tokenizer a run
has or is given, and a fresh run that trains the tokenizer the rule chose and records why."""

from __future__ import annotations

import json

import pytest
from conftest import train_tiny

from aftgen.corpus import CorpusOptions
from aftgen.device import resolve
from aftgen.training import probe, vocabulary
from aftgen.training.options import TrainOptions
from aftgen.training.plan import vocabulary_chooser
from aftgen.training.vocabulary import DEFAULT, Candidate, choose

# What issue 49's grid measured on its 30 MB corpus (characters a token on held-out text, preset small's tokens/s).
MEASURED = [Candidate(1024, 1.95, 16_500), Candidate(2048, 2.69, 15_500), Candidate(4096, 3.22, 11_900)]


def test_the_default_is_among_the_candidates():
    assert DEFAULT == CorpusOptions.vocab_size and DEFAULT in vocabulary.CANDIDATES


def test_a_large_text_and_a_short_budget_take_the_vocabulary_that_reads_the_most_text():
    chosen = choose(MEASURED, train_chars=30_000_000, budget_s=300)
    assert chosen.vocab == 2048 and "more text" in chosen.why


def test_the_default_stays_where_it_reads_within_the_noise_of_the_best():
    close = [Candidate(1024, 2.0, 10_000), Candidate(2048, 2.5, 8_150), Candidate(4096, 3.0, 5_000)]
    assert choose(close, 30_000_000, 300).vocab == DEFAULT  # 2048 reads 1.9% more: the probe's noise


def test_a_small_text_read_many_times_keeps_the_default():
    chosen = choose(MEASURED, train_chars=1_000_000, budget_s=900)  # about 29 passes at 1024
    assert chosen.vocab == DEFAULT and "the text is the limit" in chosen.why


def options(**given) -> TrainOptions:
    return TrainOptions(corpus="c.txt", out="run", **given)


@pytest.mark.parametrize(
    "given",
    [dict(vocab_size=2048, max_time=300), dict(max_steps=100), dict(init_from="base", max_time=300),
     dict(resume=True, max_time=300), dict(tokenizer_type="char", max_time=300)],
)  # fmt: skip
def test_an_explicit_vocabulary_a_budget_in_steps_fine_tuning_resuming_and_characters_keep_the_tokenizer(given):
    assert vocabulary_chooser(options(**given), resolve("cpu", "fp32"), print) is None


def test_a_fresh_run_with_a_time_budget_chooses_and_the_default_budget_is_one():
    for given in (dict(max_time=300), dict()):
        chooser = vocabulary_chooser(options(**given), resolve("cpu", "fp32"), print)
        assert chooser is not None and chooser.budget_s == (300 if given else 900)


def test_measure_trains_a_tokenizer_of_each_candidate_and_keeps_the_best_of_its_timings(monkeypatch, corpus):
    monkeypatch.setattr(vocabulary, "CANDIDATES", (400, 800))
    timed = []
    text = corpus.read_text()
    slices = [text[i : i + 4096] for i in range(0, len(text), 4096)]
    first_slow = iter([500.0, 1000.0, 900.0, 600.0])  # a busy moment slows 400's first timing
    measured = vocabulary.measure(slices, "bpe", lambda vocab: timed.append(vocab) or next(first_slow), lambda _: None)
    assert timed == [400, 800, 800, 400]  # in turn, the order reversed, so neither is always timed first
    assert [(c.vocab, c.tokens_per_s) for c in measured] == [(400, 600.0), (800, 1000.0)]  # each one's best
    assert 1 < measured[0].chars_per_token < measured[1].chars_per_token  # more pieces, longer ones


def test_a_fresh_run_trains_the_tokenizer_the_rule_chose_and_records_why(tmp_path, corpus, monkeypatch, one_thread):
    monkeypatch.setattr(vocabulary, "TOO_SMALL", 0)
    monkeypatch.setattr(vocabulary, "CANDIDATES", (400, 1024))
    monkeypatch.setattr(probe, "tokens_per_s", lambda config, batch, placement, steps=3: 1e6 / config.vocab_size)
    out = train_tiny(corpus, tmp_path / "run", vocab_size=None, max_steps=None, max_time=2, eval_interval=None)
    info = json.loads((out / "training.json").read_text())
    chosen = info["recipe"]["vocabulary"]
    assert chosen["vocab"] == 400 and "more text" in chosen["why"]
    assert [c["vocab"] for c in chosen["candidates"]] == [400, 1024]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 400
