"""Every token mixer: parallel form == step form, AFT ones == the naive formula, attention == masked softmax."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import DEVICE, on_device
from mixer_checks import (
    check_causality,
    check_prefill_last_only_gives_the_last_logits_and_the_same_state,
    check_prefill_then_step_equals_parallel,
    tiny_model,
    token_ids,
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


@pytest.mark.parametrize("s,T,chunk", [(5, 40, 8), (0, 21, 4), (4, 33, 4), (6, 13, 16)])
def test_hand_written_backward_matches_autograd_of_the_naive_formula(s, T, chunk):
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(2, T, 3, 4, generator=g) for _ in range(3)] + [
        torch.randn(3, s, generator=g),
        torch.rand(3, generator=g) * 0.3,
    ]
    inputs = [on_device(tensor) for tensor in inputs]
    weights = on_device(torch.randn(2, T, 3, 4, generator=g))  # a loss that weighs every output differently
    grads = []
    for mix in (lambda *a: aft_parallel(*a, chunk=chunk)[0], aft_naive):
        leaves = [t.double().requires_grad_() for t in inputs]
        q, k, v, w, decay = leaves
        (mix(q, soft_cap(k * 3), v, soft_cap(w * 2), decay) * weights).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for ours, reference in zip(*grads, strict=True):
        if reference is None:  # w has no entries when s == 0
            assert s == 0
            continue
        assert torch.allclose(ours, reference, atol=1e-9, rtol=1e-7)


def naive_attention(q, k, v):
    """Causal softmax attention with rotary positions, from the formulas: q, k, v are (B, H, T, D)."""
    B, H, T, D = q.shape
    angle = torch.arange(T, dtype=torch.float64)[:, None] * 10_000.0 ** (
        -torch.arange(0, D, 2, dtype=torch.float64) / D
    )
    turn = torch.polar(torch.ones_like(angle), angle)  # e^{i theta}: channel pairs (c, c + D/2) as complex numbers

    def rotate(x):
        z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * turn
        return torch.cat([z.real, z.imag], dim=-1)

    scores = rotate(q) @ rotate(k).transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def test_attention_matches_masked_softmax():
    mixer_module = tiny_model("attention").blocks[0].mixer
    x = on_device(torch.randn(2, 70, 32, generator=torch.Generator().manual_seed(6)))
    with torch.no_grad():
        y, _ = mixer_module(x)
        q, k, v = mixer_module.qkv(x).view(2, 70, 3, 4, 8).permute(2, 0, 3, 1, 4).double().cpu().unbind(0)
        mixed = on_device(naive_attention(q, k, v).transpose(1, 2).reshape(2, 70, 32).float())
        expected = mixer_module.proj(mixed)
    assert (y - expected).abs().max() < 1e-5


def test_kv_cache_grows_and_the_aft_state_does_not():
    ids = token_ids((1, 300), 7)
    sizes = {}
    for mixer in ("aft_local", "attention"):
        model = tiny_model(mixer)
        with torch.inference_mode():
            _, state = model.prefill(ids[:, :10])
            small = sum(t.numel() for layer in state for t in layer.values())
            _, state = model.prefill(ids[:, 10:], state)
            sizes[mixer] = small, sum(t.numel() for layer in state for t in layer.values())
    assert sizes["aft_local"][0] == sizes["aft_local"][1]
    assert sizes["attention"][1] > 4 * sizes["attention"][0]  # 10 tokens fill a 64-slot cache; 300 need 300


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
