"""The probe plans a run at the share of the machine it will have, and its checks within a bounded share of a
short budget (aftgen/training/probe.py): on a fake registry of peers and fake timings; nothing here is timed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fake_cores import Clock, peer

from aftgen import cores
from aftgen.cores import Registry, ThreadShare
from aftgen.device import resolve
from aftgen.model import AFTConfig
from aftgen.training import probe, recipe
from aftgen.training.options import TrainOptions

TOKENS = 100_000


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def tiny(preset: str) -> tuple[AFTConfig, int]:
    return AFTConfig(vocab_size=64, n_layer=1, n_embd=16, n_head=2, window=4, context_length=8), 2


def options(max_time: float) -> TrainOptions:
    return TrainOptions(corpus=Path("corpus.txt"), dtype="fp32", max_time=max_time, dropout=0.0)


@pytest.fixture
def joined(tmp_path, monkeypatch) -> None:
    """This process in a registry of its own, alone when it joined (every core), its clock still (the probe
    must look again for itself, not wait for the loop's next look)."""
    share = ThreadShare(Registry(tmp_path), "train", 2, say=lambda line: None, clock=Clock())
    monkeypatch.setattr(cores, "_share", share)
    assert share.look() == 2


def probed_threads(monkeypatch, when_timed=lambda: None) -> list[int]:
    """The threads each of the probe's timed steps runs with (`when_timed` is called before each)."""
    seen = []

    def training_step(model, batch, length, autocast):
        def step():
            when_timed()
            seen.append(torch.get_num_threads())

        return step

    monkeypatch.setattr(probe, "training_step", training_step)
    monkeypatch.setattr(probe, "check_seconds", lambda config, windows, device: 0.01)
    return seen


def test_the_probe_runs_at_the_share_of_a_peer_that_registered_after_this_run_looked(tmp_path, monkeypatch, joined):
    """Two runs started together: the first looked while alone, the second registered a moment later. The
    first's probe must not time its step on every core (which the second then shares): it takes its share again."""
    seen = probed_threads(monkeypatch)
    peer(tmp_path, "train")
    probe.choose_recipe(options(40.0), TOKENS, ("small",), tiny, resolve("cpu", "fp32"))
    assert seen and set(seen) == {1}


def test_a_share_that_changes_while_the_probe_runs_is_measured_again(tmp_path, monkeypatch, joined):
    """A peer that registers halfway through the probe: the plan comes from a second measurement at the new share."""
    seen = probed_threads(monkeypatch, when_timed=lambda: peer(tmp_path, "train"))
    probe.choose_recipe(options(40.0), TOKENS, ("small",), tiny, resolve("cpu", "fp32"))
    assert seen[0] == 2 and seen[-1] == 1


def planned(monkeypatch, max_time: float, check: float) -> recipe.Recipe:
    """The recipe at 20,000 tokens/s with checks of `check` seconds."""
    monkeypatch.setattr(probe, "tokens_per_s", lambda config, batch_size, placement: 20_000.0)
    monkeypatch.setattr(probe, "check_seconds", lambda config, windows, device: check)
    return probe.choose_recipe(options(max_time), TOKENS, ("small",), tiny, resolve("cpu", "fp32"))


def test_the_checks_of_a_short_budget_take_a_bounded_share_of_it(monkeypatch):
    chosen = planned(monkeypatch, max_time=40.0, check=0.5)
    checks, scores = chosen.steps // chosen.eval_interval, 2 if chosen.ema else 1
    assert 1 <= checks < recipe.CHECKS_PER_RUN
    assert checks * scores * 0.5 <= probe.CHECKS_SHARE * 40.0
    assert chosen.tokens_per_s == pytest.approx(20_000.0 * (1 - checks * scores * 0.5 / 40.0), rel=0.02)


def test_a_long_budget_keeps_its_checks(monkeypatch):
    chosen = planned(monkeypatch, max_time=900.0, check=0.5)
    assert round(chosen.steps / chosen.eval_interval) == recipe.CHECKS_PER_RUN  # the interval has 2 figures
