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
    """Bound x smoothly inside (-cap, cap); the identity near zero.

    cap tanh(x / cap), written as 2 cap sigmoid(2 x / cap) - cap (the same function): torch's CPU
    tanh is about five times slower than its sigmoid, and this runs on every key. The absolute
    error, ~1e-6 here, is what matters inside exp(k).
    """
    return (2 * cap) * torch.sigmoid(x * (2 / cap)) - cap


def full_precision(device: torch.device) -> torch.autocast:
    """Autocast off: under mixed precision the exp/sum accumulations must still run in fp32."""
    return torch.autocast(device.type, enabled=False)


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


def block_weights(w: torch.Tensor, decay: torch.Tensor, C: int, N: int, history: bool) -> dict[str, torch.Tensor]:
    """The small matrices of the chunked form, built with autograd so gradients reach w and decay.

    Position i of chunk n reads its own chunk (distances i - j: "current"), the whole block before
    it (distances C + i - j: "previous", the window and then some since C >= s) and, through
    "into", the decayed sum S_n of everything older. S_n = sum_m "carry"[n, m] * ("entry" . block m).
    """
    s, device = w.shape[1], decay.device
    weights = relative_weights(w, decay, 2 * C)  # (H, 2C): every distance the two blocks can hold
    i = torch.arange(C, device=device)
    gap = i[:, None] - i[None, :]
    mats = {"current": weights[:, gap.clamp(min=0)] * (gap >= 0)}
    if N > 1 or history:
        mats["previous"] = weights[:, C + gap]
    lam = decay[:, None]
    if N > 1:
        a = torch.arange(N - 1, device=device)
        lag = a[:, None] - a[None, :]
        mats["into"] = torch.exp(-lam * (i + 1 + C - s))[:, :, None]  # (H, C, 1)
        mats["entry"] = torch.exp(-lam * (C - i))[:, None, :]  # (H, 1, C)
        mats["carry"] = torch.exp(-lam[:, :, None] * C * lag.clamp(min=0)) * (lag >= 0)  # (H, N-1, N-1)
    return mats


def to_blocks(
    k: torch.Tensor, v: torch.Tensor, C: int, window: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """exp(k) v and exp(k) side by side, laid out (H, C, N + 1, B, 2D): row j of block n' is time (n' - 1) C + j.

    In this layout every matmul of the chunked form is one strided bmm over all chunks and sequences
    at once (batch = heads), with no permute between them. Block 0 holds the state's window, if any.
    """
    B, T, H, D = k.shape
    blocks = k.new_empty(H, C, T // C + 1, B, 2 * D)
    e = torch.exp(k)
    # One contiguous pass, then one permuting copy (writing exp straight into the strided layout is slower).
    blocks[:, :, 1:].permute(3, 2, 1, 0, 4).copy_(torch.cat([e * v, e], dim=-1).view(B, T // C, C, H, 2 * D))
    blocks[:, :, 0].zero_()
    if window is not None and window[0].shape[1]:
        win_e = torch.exp(window[0])  # (B, s, H, D), time order
        blocks[:, C - win_e.shape[1] :, 0].permute(2, 1, 0, 3).copy_(torch.cat([win_e * window[1], win_e], dim=-1))
    return blocks


def mix_blocks(blocks: torch.Tensor, mats: dict[str, torch.Tensor], prefix0: torch.Tensor | None) -> torch.Tensor:
    """Numerator and denominator sums (H, C, N, B, 2D), chunk n at [:, :, n]; prefix0 (H, B 2D) is the state's."""
    H, C, N1, B, D2 = blocks.shape
    N, width = N1 - 1, B * D2
    flat = blocks.view(H, C, N1 * width)
    out = torch.bmm(mats["current"], flat[:, :, width:])
    first = 0 if prefix0 is not None else 1  # from an empty state the first chunk has nothing before it
    if N > first:
        out[:, :, first * width :].baddbmm_(mats["previous"], flat[:, :, first * width : N * width])
    if N > 1:
        per_block = torch.bmm(mats["entry"], flat[:, :, : (N - 1) * width]).view(H, N - 1, width)
        older = torch.bmm(mats["carry"], per_block)
        if prefix0 is not None:
            older += mats["from_start"] * prefix0[:, None]
        out[:, :, width:].baddbmm_(mats["into"], older.view(H, 1, (N - 1) * width))
    if prefix0 is not None:
        out[:, :, :width].baddbmm_(mats["into_first"], prefix0[:, None])
    return out.view(H, C, N, B, D2)


def readout(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """y = sigmoid(q) * num / den, in q's (B, T, H, D) order."""
    H, C, N, B, D2 = out.shape
    by_time = out.permute(3, 2, 1, 0, 4)
    y = torch.sigmoid(q)
    y.view(B, N, C, H, D2 // 2).mul_(by_time[..., : D2 // 2]).div_(by_time[..., D2 // 2 :])
    return y


class ChunkedAFT(torch.autograd.Function):
    """The chunked form from an empty state, with a hand-written backward.

    Autograd through the block matmuls would keep every intermediate; this keeps the blocks and the
    sums and runs the backward as the same strided bmms, transposed.
    """

    MATRICES = ("current", "previous", "into", "entry", "carry")

    @staticmethod
    def forward(ctx, q, k, v, current, previous, into, entry, carry):
        mats = {"current": current, "previous": previous, "into": into, "entry": entry, "carry": carry}
        blocks = to_blocks(k, v, current.shape[-1], None)
        out = mix_blocks(blocks, mats, None)
        ctx.save_for_backward(q, v, blocks, out, current, previous, into, entry, carry)
        return readout(q, out)

    @staticmethod
    def backward(ctx, grad_y):
        q, v, blocks, out, current, previous, into, entry, carry = ctx.saved_tensors
        H, C, N1, B, D2 = blocks.shape
        N, D, width = N1 - 1, D2 // 2, B * D2
        # y = g num / den with g = sigmoid(q), in the strided (B, N, C, H, .) views of the sums, each
        # gradient written once: d num = dy g / den, d den = -d num num / den, dq = d num num (1 - g).
        by_time = out.permute(3, 2, 1, 0, 4)
        num, den = by_time[..., :D], by_time[..., D:]
        gate = torch.sigmoid(q).view(B, N, C, H, D)
        grad_out = torch.empty_like(out)
        grad_sums = grad_out.permute(3, 2, 1, 0, 4)
        grad_num, grad_den = grad_sums[..., :D], grad_sums[..., D:]
        torch.div(grad_y.reshape(B, N, C, H, D) * gate, den, out=grad_num)
        scaled = torch.mul(grad_num, num, out=torch.empty_like(gate))  # in gate's (time-major) layout
        torch.div(scaled, den, out=grad_den).neg_()
        grad_q = torch.addcmul(scaled, scaled, gate, value=-1).view(B, N * C, H, D)
        G, flat = grad_out.view(H, C, N * width), blocks.view(H, C, N1 * width)
        grad_blocks = torch.bmm(current.transpose(1, 2), G)  # chunk n here is block n + 1
        grads = {"current": torch.bmm(G, flat[:, :, width:].transpose(1, 2))}
        if N > 1:
            grad_blocks[:, :, : (N - 1) * width].baddbmm_(previous.transpose(1, 2), G[:, :, width:])
            grads["previous"] = torch.bmm(G[:, :, width:], flat[:, :, width : N * width].transpose(1, 2))
            per_block = torch.bmm(entry, flat[:, :, : (N - 1) * width]).view(H, N - 1, width)
            older = torch.bmm(carry, per_block)
            grad_older = torch.bmm(into.transpose(1, 2), G[:, :, width:]).view(H, N - 1, width)
            grad_per_block = torch.bmm(carry.transpose(1, 2), grad_older)
            if N > 2:  # block 0 is the (empty) history: only blocks 1 .. N-2 feed later chunks
                grad_blocks[:, :, : (N - 2) * width].baddbmm_(
                    entry.transpose(1, 2), grad_per_block[:, 1:].reshape(H, 1, (N - 2) * width)
                )
            grads["into"] = torch.bmm(G[:, :, width:], older.view(H, (N - 1) * width, 1))
            grads["entry"] = torch.bmm(
                grad_per_block.view(H, 1, (N - 1) * width), flat[:, :, : (N - 1) * width].transpose(1, 2)
            )
            grads["carry"] = torch.bmm(grad_older, per_block.transpose(1, 2))
        gz = grad_blocks.view(H, C, N, B, D2).permute(3, 2, 1, 0, 4)  # (B, N, C, H, 2D)
        e = blocks[:, :, 1:].permute(3, 2, 1, 0, 4)[..., D:]
        # Written into fresh (B, T, H, D) tensors: a product of these strided views would keep their
        # layout and cost another pass to make contiguous. z = (e v, e): dv = dz_num e, dk = dv v + dz_den e.
        grad_v = torch.mul(gz[..., :D], e, out=v.new_empty(B, N, C, H, D))
        grad_k = torch.mul(gz[..., D:], e, out=v.new_empty(B, N, C, H, D)).addcmul_(grad_v, v.view(B, N, C, H, D))
        grad_v, grad_k = grad_v.view(B, N * C, H, D), grad_k.view(B, N * C, H, D)
        return grad_q, grad_k, grad_v, *(grads.get(name) for name in ChunkedAFT.MATRICES)


def aft_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    decay: torch.Tensor,
    chunk: int = 32,
    state: MixerState | None = None,
    return_state: bool = False,
    last_only: bool = False,
) -> tuple[torch.Tensor, MixerState | None]:
    """Causal AFT-local over a whole sequence in O(T C D) time and O(T D) memory.

    k and w must already be soft-capped. The sequence is cut into chunks of C = max(chunk, s) tokens.
    Position i of chunk n sees three groups of tokens:
      - its own chunk, tokens j <= i: a C x C lower-triangular matmul with weights exp(b[i - j]);
      - the whole chunk before: a C x C matmul with weights exp(b[C + i - j]) (holds the window);
      - everything older: a decayed running sum S_n (exactly the recurrent state's prefix at a
        chunk boundary) weighted exp(-lambda (i + 1 + C - s)); S over all chunks is one small
        (N x N) matmul with weights exp(-lambda C (n - 1 - m)).
    No subtraction anywhere, so nothing cancels when w << 0. Training (no state) runs through
    ChunkedAFT's hand-written backward; gradients through a carried state are not supported.

    With `state`, the sequence continues from it (its window and prefix), and with `return_state`
    the state after the last token is returned, so long streams can be read chunk by chunk.
    `last_only` gives y for the last token alone (B, 1, H, D), read from that state: reading a
    prompt needs no other, and skipping the chunk sums leaves only the fold into the state.
    """
    B, T, H, D = k.shape
    s = w.shape[1]
    C = max(chunk, s, 1)
    N = math.ceil(T / C)
    device = k.device
    dtype = torch.promote_types(k.dtype, torch.float32)
    q, k, v, w, decay = (t.to(dtype) for t in (q, k, v, w, decay))
    if N * C != T:  # pad to whole chunks with tokens that weigh nothing (exp(EMPTY_KEY) == 0)
        pad = (0, 0, 0, 0, 0, N * C - T)
        q, k, v = F.pad(q, pad), F.pad(k, pad, value=EMPTY_KEY), F.pad(v, pad)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, w, decay))
    if state is None and not return_state and not last_only:
        mats = block_weights(w, decay, C, N, history=False)
        if needs_grad:
            y = ChunkedAFT.apply(q, k, v, *(mats.get(name) for name in ChunkedAFT.MATRICES))
        else:
            y = readout(q, mix_blocks(to_blocks(k, v, C, None), mats, None))
        return y[:, :T], None
    if needs_grad:
        raise ValueError("aft_parallel: gradients through a carried state are not supported")

    if state is None:
        state = empty_state(B, H, D, s, device)
    # The state's window is a ring buffer (token g lives in slot g mod s): unroll it to time order.
    # Positions stay tensors, so reading a chunk never waits on the host and compiles to one graph.
    position, slots = state["position"], torch.arange(s, device=device)
    time_order = (slots + position) % s
    win_k, win_v = state["window_k"].index_select(1, time_order), state["window_v"].index_select(1, time_order)
    prefix0 = torch.cat([state["prefix_num"], state["prefix_den"]], dim=-1) * torch.exp(state["prefix_max"]).repeat(
        1, 1, 2
    )
    prefix0 = prefix0.transpose(0, 1).reshape(H, B * 2 * D)
    blocks = to_blocks(k, v, C, (win_k, win_v))
    i = torch.arange(C, device=device)
    if not last_only:
        mats = block_weights(w, decay, C, N, history=True)
        lam = decay[:, None]
        mats["into_first"] = torch.exp(-lam * (i + 1))[:, :, None]  # the state's prefix seen from chunk 0
        if N > 1:
            mats["from_start"] = torch.exp(-lam * (torch.arange(N - 1, device=device) * C + s))[:, :, None]
        y = readout(q, mix_blocks(blocks, mats, prefix0))[:, :T]
        if not return_state:
            return y, None

    # The prefix after the last token: every token older than the new window, decayed to time T.
    time = (torch.arange(N + 1, device=device)[None, :] - 1) * C + i[:, None]  # of each block row (C, N + 1)
    age = T - s - time
    kept = (age >= 1) & (time >= -s)  # block 0 holds real tokens only in its last s rows
    fold = torch.where(kept, torch.exp(-decay[:, None, None] * age.clamp(min=0)), 0.0)  # (H, C, N + 1)
    history = prefix0.view(H, B, 2 * D).transpose(0, 1)
    final = torch.einsum("hjn,hjnbd->bhd", fold, blocks) + torch.exp(-decay * T)[None, :, None] * history
    new_position = position + T
    ring_order = (slots - new_position) % s
    newest = max(T - s, 0)  # the last s keys and values, from the window and the new tokens
    keys = torch.cat([win_k, k[:, newest:T]], dim=1)[:, T - newest :]
    values = torch.cat([win_v, v[:, newest:T]], dim=1)[:, T - newest :]
    new_state = {
        "window_k": keys.index_select(1, ring_order),
        "window_v": values.index_select(1, ring_order),
        "prefix_num": final[..., :D].contiguous(),
        "prefix_den": final[..., D:].contiguous(),
        "prefix_max": torch.zeros_like(final[..., :D]),
        "position": new_position,
    }
    if last_only:
        y = latest_output(q[:, T - 1], w, new_state, new_position - 1)[:, None]
    return y, new_state if return_state else None


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
        win_k.index_copy_(1, slot, k[:, None])
        win_v.index_copy_(1, slot, v[:, None])
    y = latest_output(q, w, state, position)
    position.add_(1)
    return y


def latest_output(q: torch.Tensor, w: torch.Tensor, state: MixerState, newest: torch.Tensor) -> torch.Tensor:
    """y of the newest token (at position `newest`, q (B, H, D)), read from a state that already holds it.

    Its window holds the last s tokens, weighted exp(k + w[distance]); its prefix, everything older,
    already decayed to this token. Max-stabilised, like the prefix itself.
    """
    s = w.shape[1]
    a, b, p = state["prefix_num"], state["prefix_den"], state["prefix_max"]
    if s:
        win_k, win_v = state["window_k"], state["window_v"]
        distance = (newest - torch.arange(s, device=q.device)) % s  # of each slot's token
        scores = win_k + w[:, distance].T[None, :, :, None]  # (B, s, H, D)
        top = torch.maximum(p, scores.amax(dim=1))
        window_scale = torch.exp(scores - top[:, None])
        prefix_scale = torch.exp(p - top)
        num = a * prefix_scale + (window_scale * win_v).sum(dim=1)
        den = b * prefix_scale + window_scale.sum(dim=1)
    else:
        num, den = a, b
    return torch.sigmoid(q) * num / den


def focused_window_bias(n_head: int, window: int) -> torch.Tensor:
    """The initial w: head h favours the last few tokens, w[h, d] = (ln s + 1) exp(-d / tau_h).

    The paper starts w at 0, so that every head first averages its whole window evenly. A language
    model needs heads that look at the last token or two, and learning that from w = 0 took most of
    a short run: 150 s of preset small scored 1.695 nats/char from w = 0 and 1.582 from this start.
    Focus lengths tau go from s/2 down to half a token, so some heads stay broad. w stays >= 0,
    above the weight of everything beyond the window (<= 1), so no head starts out looking past
    its window more than inside it.
    """
    if window == 0:
        return torch.zeros(n_head, 0)
    focus = torch.logspace(math.log10(window / 2), math.log10(0.5), n_head)[:, None]
    return (math.log(window) + 1) * torch.exp(-torch.arange(window)[None, :] / focus)


class AFTLocalMixer(torch.nn.Module):
    """Multi-head causal AFT-local: projections around `aft_parallel` / `aft_step`."""

    def __init__(self, n_embd: int, n_head: int, window: int, context_length: int, decay: bool, chunk: int = 32):
        super().__init__()
        self.n_head, self.head_dim, self.chunk = n_head, n_embd // n_head, chunk
        self.qkv = torch.nn.Linear(n_embd, 3 * n_embd)
        self.proj = torch.nn.Linear(n_embd, n_embd)
        self.w = torch.nn.Parameter(focused_window_bias(n_head, window))
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
        self, x: torch.Tensor, state: MixerState | None = None, return_state: bool = False, last_only: bool = False
    ) -> tuple[torch.Tensor, MixerState | None]:
        q, k, v = self._qkv(x)
        with full_precision(x.device):
            y, state = aft_parallel(q, k, v, soft_cap(self.w), self.decay(), self.chunk, state, return_state, last_only)
        return self.proj(y.to(x.dtype).flatten(-2)), state

    def step(self, x: torch.Tensor, state: MixerState) -> torch.Tensor:
        q, k, v = self._qkv(x)
        with full_precision(x.device):
            y = aft_step(q.float(), k, v.float(), soft_cap(self.w), self.decay(), state)
        return self.proj(y.to(x.dtype).flatten(-2))


# The baseline the paper compares against: causal multi-head softmax attention. It has no relative
# biases, so positions come from rotary embeddings (RoPE), which also let it read past its training
# length. Generation keeps a KV cache: memory and per-token cost grow with the context.

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

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.qkv = torch.nn.Linear(n_embd, 3 * n_embd)
        self.proj = torch.nn.Linear(n_embd, n_embd)

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
