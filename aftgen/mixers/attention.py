"""Causal multi-head softmax attention: the baseline the paper compares AFT against.

It has no relative biases, so positions come from rotary embeddings (RoPE), which also let it read
past its training length. Generation keeps a KV cache: memory and per-token cost grow with the context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aftgen.layers import Linear
from aftgen.mixers.protocol import MixerConfig, MixerState

ROPE_BASE = 10_000.0


def rotary(x: torch.Tensor, start: int) -> torch.Tensor:
    """Rotate channel pairs of x (B, H, T, D) by angles of positions start .. start + T - 1 (RoPE)."""
    D, T = x.shape[-1], x.shape[-2]
    inv_freq = ROPE_BASE ** -(torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = torch.arange(start, start + T, device=x.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def empty_cache(batch: int, heads: int, head_dim: int, device=None) -> MixerState:
    """A KV cache holding no tokens. keys/values are (B, H, capacity, D); `position` tokens are filled."""
    return {
        "keys": torch.zeros(batch, heads, 0, head_dim, device=device),
        "values": torch.zeros(batch, heads, 0, head_dim, device=device),
        "position": torch.zeros((), dtype=torch.long, device=device),
    }


def filled_cache(batch: int, heads: int, head_dim: int, tokens: int, room: int) -> MixerState:
    """A KV cache already holding `tokens` random keys and values, with room for `room` more: what a
    step costs depends on how many there are, not what they are (the decode benchmark's long contexts,
    which would take minutes to read through attention)."""
    shape = (batch, heads, tokens + room, head_dim)
    return {"keys": torch.randn(shape), "values": torch.randn(shape), "position": torch.tensor(tokens)}


def append_to_cache(cache: MixerState, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k, v (B, H, T, D) after the cached tokens, in place; return all keys and values so far.

    The buffers grow by doubling, so appending one token costs O(1) amortised instead of a full copy.
    """
    start, T = int(cache["position"]), k.shape[2]
    capacity = cache["keys"].shape[2]
    if start + T > capacity:
        grown = max(2 * capacity, start + T, 64)
        for name in ("keys", "values"):
            old = cache[name]
            cache[name] = old.new_zeros(old.shape[0], old.shape[1], grown, old.shape[3])
            cache[name][:, :, :start] = old[:, :, :start]
    cache["keys"][:, :, start : start + T] = k
    cache["values"][:, :, start : start + T] = v
    cache["position"].add_(T)
    return cache["keys"][:, :, : start + T], cache["values"][:, :, : start + T]


class AttentionMixer(torch.nn.Module):
    """Causal multi-head softmax attention (torch's scaled_dot_product_attention) with RoPE and a KV cache."""

    no_weight_decay = ()
    fixed_size_state = False  # a KV cache grows with the stream, and RoPE is untrained past the training length

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.qkv = Linear(n_embd, 3 * n_embd)
        self.proj = Linear(n_embd, n_embd)

    @classmethod
    def from_config(cls, config: MixerConfig) -> AttentionMixer:
        return cls(config.n_embd, config.n_head)

    @classmethod
    def shaping_fields(cls, config: MixerConfig) -> tuple[str, ...]:
        return ()

    def perturb_(self) -> None:
        """Nothing to draw: its projections start random, and it has no biases by position or decays."""

    def initial_state(self, batch_size: int, device=None) -> MixerState:
        return empty_cache(batch_size, self.n_head, self.head_dim, device)

    def forward(
        self, x: torch.Tensor, state: MixerState | None = None, return_state: bool = False, last_only: bool = False
    ) -> tuple[torch.Tensor, MixerState | None]:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if state is None and not return_state and not last_only:  # training: one causal pass, nothing kept
            y = F.scaled_dot_product_attention(rotary(q, 0), rotary(k, 0), v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, T, -1)), None
        if state is None:
            state = self.initial_state(B, x.device)
        start = int(state["position"])
        keys, values = append_to_cache(state, rotary(k, start), v)
        # Query i (at position start + i) sees every cached token and the new ones up to itself; a
        # single query, the last, sees everything, so it needs no mask (and torch keeps its fastest kernel).
        queries = 1 if last_only else T
        mask = None
        if queries > 1:
            mask = (
                torch.arange(start + T, device=x.device)[None, :] <= start + torch.arange(T, device=x.device)[:, None]
            )
        y = F.scaled_dot_product_attention(
            rotary(q[:, :, T - queries :], start + T - queries), keys, values, attn_mask=mask
        )
        return self.proj(y.transpose(1, 2).reshape(B, queries, -1)), state

    def step(self, x: torch.Tensor, state: MixerState) -> torch.Tensor:
        y, _ = self.forward(x[:, None], state, return_state=True)
        return y[:, 0]
