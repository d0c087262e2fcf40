"""The attention mixer (aftgen/mixers/attention.py): masked softmax with rotary positions, and a cache that grows."""

from __future__ import annotations

import math

import torch
from conftest import on_device
from mixer_checks import tiny_model, token_ids


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
