"""Every token mixer: parallel form == step form, AFT ones == the naive formula, each trained through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DEVICE, on_device
from mixer_checks import (
    check_causality,
    check_prefill_last_only_gives_the_last_logits_and_the_same_state,
    check_prefill_then_step_equals_parallel,
    tiny_model,
)
from typer.testing import CliRunner

from aftgen.cli import app
from aftgen.mixers import MIXERS, AFTMixer
from aftgen.mixers.aft import aft_naive, aft_parallel, soft_cap

AFT_MIXERS = [name for name, kind in MIXERS.items() if kind.mixer is AFTMixer]
runner = CliRunner()


@pytest.mark.parametrize("mixer", MIXERS)
def test_prefill_then_step_equals_parallel(mixer):
    check_prefill_then_step_equals_parallel(mixer)


@pytest.mark.parametrize("mixer", MIXERS)
def test_prefill_last_only_gives_the_last_logits_and_the_same_state(mixer):
    check_prefill_last_only_gives_the_last_logits_and_the_same_state(mixer)


@pytest.mark.parametrize("mixer", MIXERS)
def test_causality(mixer):
    check_causality(mixer)


@pytest.mark.parametrize("mixer", AFT_MIXERS)
def test_aft_mixers_match_the_naive_formula(mixer):
    mixer_module = tiny_model(mixer).blocks[0].mixer
    expected_window = {"aft_local": 8, "aft_simple": 0, "aft_full": 64}[mixer]
    assert mixer_module.w.shape[1] == expected_window
    x = on_device(torch.randn(2, 70, 32, generator=torch.Generator().manual_seed(4)))
    with torch.no_grad():
        q, k, v = mixer_module._qkv(x)
        w, decay = soft_cap(mixer_module.w), mixer_module.decay()
        y, _ = aft_parallel(q, k, v, w, decay, chunk=mixer_module.chunk)
    assert (y.double() - aft_naive(q, k, v, w, decay)).abs().max() < 1e-5


def test_train_sample_eval_with_the_attention_mixer(tmp_path, corpus):
    out = tmp_path / "attention"
    args = ["train", str(corpus), "--out", str(out), "--preset", "tiny", "--mixer", "attention", "--max-steps", "6",
            "--device", DEVICE]  # fmt: skip
    result = runner.invoke(app, [*args, "--eval-interval", "3", "--vocab-size", "300", "--quiet"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["mixer"] == "attention"
    sampled = runner.invoke(
        app, ["sample", "--model", str(out), "-p", "KING:", "-n", "20", "--seed", "1", "--device", DEVICE]
    )
    assert sampled.exit_code == 0, sampled.output
    scored = runner.invoke(app, ["eval", "--model", str(out), str(corpus), "--json", "--device", DEVICE])
    assert scored.exit_code == 0, scored.output
    assert json.loads(scored.stdout)["nats_per_char"] > 0


def test_unknown_mixer_is_one_line(tmp_path, corpus):
    result = runner.invoke(app, ["train", str(corpus), "--out", str(tmp_path / "x"), "--mixer", "lstm"])
    assert result.exit_code == 2
    assert "unknown --mixer 'lstm'" in result.output
    assert "Traceback" not in result.output
