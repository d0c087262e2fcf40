"""The AFT-local token mixer: a parallel form for training and a step form for generation.

Per head h and channel c (Zhai et al. 2021, "An Attention Free Transformer", causal AFT-local):

    y_t = sigmoid(q_t) * sum_{t'<=t} exp(k_t' + b[h, t-t']) v_t' / sum_{t'<=t} exp(k_t' + b[h, t-t'])

with a relative position bias b[h, d] = w[h, d] for d < s (the window) and, beyond it,
b[h, d] = -lambda_h * (d - s + 1) with a learned per-head decay lambda_h >= 0. lambda = 0 is the
paper's AFT-local exactly (every past token keeps weight exp(k) forever); a small positive lambda
keeps the average over the far past the same whether the model reads 100 tokens or 100k, which is
what lets a model trained on short windows stream past its training length.

Numerical safety by construction: keys are soft-capped, k -> KEY_CAP * tanh(k / KEY_CAP), and so are
the window biases w. Every weight exp(k + b) then lies in [exp(-2 KEY_CAP), exp(2 KEY_CAP)] (or
decays below that towards 0 far in the past), so no sum can overflow in fp32 for any practical
length (e^20 * 1e20 tokens < fp32 max), and the denominator always holds the current token's own
weight (>= e^-20), so it never underflows to 0. tanh is the identity near 0, so ordinary keys are
untouched.

Shapes: q, k, v are (B, T, H, D): batch, time, heads, channels per head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

KEY_CAP = 10.0
EMPTY_KEY = -1e4  # key of an unfilled window slot: exp(EMPTY_KEY - m) == 0 for any m in range

MixerState = dict[str, torch.Tensor]


def soft_cap(x: torch.Tensor, cap: float = KEY_CAP) -> torch.Tensor:
    """Bound x smoothly inside (-cap, cap); the identity near zero."""
    return cap * torch.tanh(x / cap)


def relative_weights(w: torch.Tensor, decay: torch.Tensor, length: int) -> torch.Tensor:
    """exp(b[h, d]) for 0 <= d < length: exp(w) inside the window, exp(-lambda (d - s + 1)) beyond."""
    window = w.shape[1]
    d = torch.arange(length, device=decay.device)
    beyond = torch.exp(-decay[:, None] * (d - window + 1).clamp(min=0))
    if window == 0:
        return beyond
    inside = F.pad(torch.exp(w), (0, max(length - window, 0)))[:, :length]
    return torch.where(d < window, inside, beyond)


def empty_state(batch: int, heads: int, head_dim: int, window: int, device=None) -> MixerState:
    """The state before any token: an empty window and an empty prefix."""
    zeros = torch.zeros(batch, heads, head_dim, device=device)
    return {
        "window_k": torch.full((batch, window, heads, head_dim), EMPTY_KEY, device=device),
        "window_v": torch.zeros(batch, window, heads, head_dim, device=device),
        "prefix_num": zeros.clone(),
        "prefix_den": zeros.clone(),
        "prefix_max": torch.full_like(zeros, EMPTY_KEY),
        "position": torch.zeros((), dtype=torch.long, device=device),
    }


def aft_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    decay: torch.Tensor,
    chunk: int = 64,
    state: MixerState | None = None,
    return_state: bool = False,
) -> tuple[torch.Tensor, MixerState | None]:
    """Causal AFT-local over a whole sequence in O(T s D) time and O(T D) memory.

    k and w must already be soft-capped. The sequence is cut into chunks of C >= s tokens. For
    position i of chunk n, the tokens fall in three groups:
      - the chunk itself, tokens j <= i: a C x C lower-triangular matmul with weights exp(b[i - j]);
      - the s tokens just before the chunk: a C x s matmul with weights exp(b[i + s - j]);
      - everything older: a decayed running sum U_n ("the prefix", exactly the recurrent state's
        prefix at the chunk boundary), weighted exp(-lambda (i + 1)).
    U_n over all chunks is one small (N x N) matmul with weights exp(-lambda C (n - 1 - m)): no
    subtraction anywhere, so nothing cancels when w << 0.

    With `state`, the sequence continues from it (its window and prefix), and with `return_state`
    the state after the last token is returned, so long streams can be read chunk by chunk.
    """
    B, T, H, D = k.shape
    s = w.shape[1]
    C = max(chunk, s, 1)
    N = math.ceil(T / C)
    device = k.device
    decay = decay.float()

    e = torch.exp(k.float())
    z = torch.cat([e * v.float(), e], dim=-1)  # numerator and denominator terms side by side
    if state is None:
        state = empty_state(B, H, D, s, device)
    position = int(state["position"])
    # The state's window is a ring buffer (token g lives in slot g mod s): unroll it to time order.
    win_k = state["window_k"].roll(-position % s if s else 0, dims=1)
    win_v = state["window_v"].roll(-position % s if s else 0, dims=1)
    win_e = torch.exp(win_k)
    z_window = torch.cat([win_e * win_v, win_e], dim=-1)
    prefix0 = torch.cat(
        [state["prefix_num"], state["prefix_den"]], dim=-1
    ) * torch.exp(state["prefix_max"]).repeat(1, 1, 2)

    z_full = torch.cat([z_window, z, z.new_zeros(B, N * C - T, H, 2 * D)], dim=1)
    chunks = z_full[:, s:].reshape(B, N, C, H, 2 * D)
    shifted = z_full[:, : N * C].reshape(B, N, C, H, 2 * D)  # shifted[:, n, j] = token nC + j - s

    weights = relative_weights(w, decay, s + C)  # (H, s + C)
    i = torch.arange(C, device=device)
    gap = i[:, None] - i[None, :]
    m_chunk = weights[:, gap.clamp(min=0)] * (gap >= 0)  # (H, C, C)
    out = torch.einsum("hij,bnjhd->bnihd", m_chunk, chunks)
    if s:
        m_window = weights[:, i[:, None] + s - torch.arange(s, device=device)[None, :]]  # (H, C, s)
        out = out + torch.einsum("hij,bnjhd->bnihd", m_window, shifted[:, :, :s])

    # Prefix: U_{n+1} = exp(-lambda C) U_n + sum_j exp(-lambda (C - j)) shifted[n, j].
    entry = torch.exp(-decay[None, :] * (C - i)[:, None])  # (C, H)
    per_chunk = torch.einsum("jh,bnjhd->bnhd", entry, shifted)
    n = torch.arange(N, device=device)
    lag = n[:, None] - 1 - n[None, :]
    carry = torch.exp(-decay[:, None, None] * C * lag.clamp(min=0)) * (lag >= 0)  # (H, N, N)
    from_start = torch.exp(-decay[None, :] * C * n[:, None])  # (N, H)
    prefix = torch.einsum("hnm,bmhd->bnhd", carry, per_chunk) + from_start[None, :, :, None] * prefix0[:, None]
    into_chunk = torch.exp(-decay[None, :] * (i + 1)[:, None])  # (C, H)
    out = out + into_chunk[None, None, :, :, None] * prefix[:, :, None]

    out = out.reshape(B, N * C, H, 2 * D)[:, :T]
    num, den = out.split(D, dim=-1)
    y = torch.sigmoid(q.float()) * num / den

    if not return_state:
        return y, None
    # The prefix after the last token: U at the start of the last chunk plus its first r entries.
    r = T - (N - 1) * C
    tail = torch.exp(-decay[None, :] * (r - torch.arange(r, device=device))[:, None])  # (r, H)
    final = torch.exp(-decay * r)[None, :, None] * prefix[:, -1] + torch.einsum(
        "jh,bjhd->bhd", tail, shifted[:, -1, :r]
    )
    new_position = position + T
    keys = torch.cat([win_k, k.float()], dim=1)[:, T:]  # the last s keys and values
    values = torch.cat([win_v, v.float()], dim=1)[:, T:]
    new_state = {
        "window_k": keys.roll(new_position % s if s else 0, dims=1),
        "window_v": values.roll(new_position % s if s else 0, dims=1),
        "prefix_num": final[..., :D],
        "prefix_den": final[..., D:],
        "prefix_max": torch.zeros_like(final[..., :D]),
        "position": torch.tensor(new_position, device=device),
    }
    return y, new_state


def aft_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    decay: torch.Tensor,
    state: MixerState,
) -> torch.Tensor:
    """One token of causal AFT-local, updating `state` in place: O(s D) work, constant memory.

    q, k, v are (B, H, D); k and w already soft-capped. The token leaving the window moves into the
    prefix, kept as max-stabilised running sums (RWKV's (a, b, p) trick: the true sums are
    prefix_num * exp(prefix_max) and prefix_den * exp(prefix_max)).

    Written for speed without changing the math: the position stays a tensor and the window slot is
    addressed with index_select / index_copy_, so there is no host sync, no copy of the leaving
    token (it is read before its slot is overwritten) and nothing that stops torch.compile from
    fusing the whole step into a few kernels.
    """
    s = w.shape[1]
    position = state["position"]
    win_k, win_v = state["window_k"], state["window_v"]
    if s:
        slot = (position % s).view(1)
        leaving_k, leaving_v = win_k.index_select(1, slot)[:, 0], win_v.index_select(1, slot)[:, 0]
    else:
        leaving_k, leaving_v = k, v

    # Fold the leaving token (distance s: weight exp(k - lambda)) into the prefix, decaying the rest.
    a, b, p = state["prefix_num"], state["prefix_den"], state["prefix_max"]
    top = torch.maximum(p, leaving_k)
    old_scale, new_scale = torch.exp(p - top), torch.exp(leaving_k - top)
    a.mul_(old_scale).add_(new_scale * leaving_v)
    b.mul_(old_scale).add_(new_scale)
    p.copy_(top - decay[None, :, None])

    if s:
        win_k[:, slot] = k
        win_v[:, slot] = v
        distance = (position - torch.arange(s, device=k.device)) % s  # of each slot's token
        scores = win_k + w[:, distance].T[None, :, :, None]  # (B, s, H, D)
        top = torch.maximum(p, scores.amax(dim=1))
        window_scale = torch.exp(scores - top[:, None])
        prefix_scale = torch.exp(p - top)
        num = a * prefix_scale + (window_scale * win_v).sum(dim=1)
        den = b * prefix_scale + window_scale.sum(dim=1)
    else:
        num, den = a, b
    state["position"].add_(1)
    return torch.sigmoid(q) * num / den


class AFTLocalMixer(torch.nn.Module):
    """Multi-head causal AFT-local: projections around `aft_parallel` / `aft_step`."""

    def __init__(self, n_embd: int, n_head: int, window: int, context_length: int, decay: bool, chunk: int = 64):
        super().__init__()
        self.n_head, self.head_dim, self.chunk = n_head, n_embd // n_head, chunk
        self.qkv = torch.nn.Linear(n_embd, 3 * n_embd)
        self.proj = torch.nn.Linear(n_embd, n_embd)
        self.w = torch.nn.Parameter(torch.zeros(n_head, window))  # the paper initialises w at 0
        # Heads start with horizons from about the training length down to the window, so some
        # look far back and some stay local; softplus keeps lambda >= 0.
        horizons = torch.logspace(math.log10(context_length), math.log10(max(window, 2) / 2), n_head)
        self.decay_logit = torch.nn.Parameter(torch.log(torch.expm1(1.0 / horizons)), requires_grad=decay)
        self.learn_decay = decay

    def decay(self) -> torch.Tensor:
        if not self.learn_decay:
            return torch.zeros_like(self.decay_logit)
        return F.softplus(self.decay_logit)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).split(self.n_head * self.head_dim, dim=-1)
        shape = (*x.shape[:-1], self.n_head, self.head_dim)
        return q.view(shape), soft_cap(k.view(shape).float()), v.view(shape)

    def initial_state(self, batch_size: int, device=None) -> MixerState:
        return empty_state(batch_size, self.n_head, self.head_dim, self.w.shape[1], device)

    def forward(
        self, x: torch.Tensor, state: MixerState | None = None, return_state: bool = False
    ) -> tuple[torch.Tensor, MixerState | None]:
        q, k, v = self._qkv(x)
        y, state = aft_parallel(q, k, v, soft_cap(self.w), self.decay(), self.chunk, state, return_state)
        return self.proj(y.to(x.dtype).flatten(-2)), state

    def step(self, x: torch.Tensor, state: MixerState) -> torch.Tensor:
        q, k, v = self._qkv(x)
        y = aft_step(q.float(), k, v.float(), soft_cap(self.w), self.decay(), state)
        return self.proj(y.to(x.dtype).flatten(-2))
