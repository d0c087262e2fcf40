"""Causal AFT-local (Zhai et al. 2021, "An Attention Free Transformer"), the model's token mixer.

Per head h and channel c, token t reads every token t' <= t:

    y_t = sigmoid(q_t) * sum_{t'<=t} exp(k_t' + b[h, t-t']) v_t' / sum_{t'<=t} exp(k_t' + b[h, t-t'])

with a relative position bias b[h, d] = w[h, d] for d < s (the window) and, beyond it,
b[h, d] = -lambda_h * (d - s + 1) with a learned per-head decay lambda_h >= 0. lambda = 0 is the
paper's AFT-local exactly (every past token keeps weight exp(k) forever); a small positive lambda
keeps the average over the far past the same whether the model reads 100 tokens or 100k, which is
what lets a model trained on short windows stream past its training length.

Three forms compute it:
- `aft_naive`: the formula as written, O(T^2). The readable path, and the tests' oracle.
- `aft_parallel`: the same sums over a whole sequence in chunks (chunked.py): training and prompts.
- `aft_step`: one token at a time from a fixed-size state: the last s tokens' exp(k) and v, plus
  max-stabilised running sums of exp(k) v and exp(k) over everything older (RWKV's (a, b, p) trick:
  the true sums are prefix_num * exp(prefix_max) and prefix_den * exp(prefix_max)). The window keeps
  exp(k), not k, so that a token's weights exp(k + w) = exp(k) exp(w) are products: a step takes no
  exponential over its window (s H D a row; an eager step of 32 rows took half the time without them).

The window is a ring buffer: each row counts the tokens it has read (its own `position`, one per row),
and its token g sits in slot g mod s. A row's window then lies in the same slots, and its sums over them
run in the same order, alone or in a batch beside rows that have read other numbers of tokens: rows of
any history stack as they are (aftgen.serve.batch), and a row's output does not depend on the others.

Numerical safety: keys and window biases are soft-capped into (-KEY_CAP, KEY_CAP), so every weight
exp(k + b) lies in [exp(-2 KEY_CAP), exp(2 KEY_CAP)] (or decays below that, far in the past). No sum
can overflow in fp32 at any practical length, and the denominator always holds the current token's
own weight, so it never underflows to 0. The same bounds let a token's output be read from the state
without a max pass: its window weights are bounded, and the prefix's stabiliser never rises above KEY_CAP.

Shapes: q, k, v are (B, T, H, D) (batch, time, heads, channels per head), or (B, H, D) for one token.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from aftgen.layers import Linear
from aftgen.mixers.chunked import EMPTY_KEY, History, aft_chunked, aft_chunked_from
from aftgen.mixers.protocol import MixerConfig, MixerState

KEY_CAP = 10.0
# The config field that sets each AFT mixer's window s (None: no window, the decay alone).
WINDOW_FIELDS = {"aft_local": "window", "aft_simple": None, "aft_full": "context_length"}


def soft_cap(x: torch.Tensor, cap: float = KEY_CAP) -> torch.Tensor:
    """cap * tanh(x / cap): bounded inside (-cap, cap), the identity near zero.

    Written as 2 cap sigmoid(2 x / cap) - cap, the same function: torch's CPU tanh is about five times
    slower than its sigmoid, and this runs on every key.
    """
    return (2 * cap) * torch.sigmoid(x * (2 / cap)) - cap


def aft_naive(q, k, v, w: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """The formula above, term by term, in float64: y (B, T, H, D). O(T^2): for reading and testing."""
    B, T, H, D = k.shape
    s = w.shape[1]
    q, k, v, w, decay = (x.double() for x in (q, k, v, w, decay))
    y = torch.empty(B, T, H, D, dtype=torch.float64, device=k.device)
    for t in range(T):
        num = torch.zeros(B, H, D, dtype=torch.float64, device=k.device)
        den = torch.zeros_like(num)
        for earlier in range(t + 1):
            d = t - earlier
            bias = w[:, d] if d < s else -decay * (d - s + 1)  # (H,)
            weight = torch.exp(k[:, earlier] + bias[None, :, None])  # (B, H, D)
            num += weight * v[:, earlier]
            den += weight
        y[:, t] = torch.sigmoid(q[:, t]) * num / den
    return y


def empty_state(batch: int, heads: int, head_dim: int, window: int, device=None) -> MixerState:
    """The state before any token: an empty window (a ring buffer: a row's token g in slot g mod s) and prefix."""
    zeros = torch.zeros(batch, heads, head_dim, device=device)
    return {
        "window_exp_k": torch.zeros(batch, window, heads, head_dim, device=device),  # (B, s, H, D): exp(k), 0 empty
        "window_v": torch.zeros(batch, window, heads, head_dim, device=device),  # (B, s, H, D)
        "prefix_num": zeros.clone(),  # (B, H, D)
        "prefix_den": zeros.clone(),  # (B, H, D)
        "prefix_max": torch.full_like(zeros, EMPTY_KEY),  # (B, H, D)
        "position": torch.zeros(batch, dtype=torch.long, device=device),  # (B,): tokens each row has read
    }


class StepTables(NamedTuple):
    """What the step reads of the window bias and the decay, laid out for it once per change of the parameters."""

    window_weight: torch.Tensor  # (s + 1, s, H): row s - 1 - (n mod s) is every slot's exp(w) when token n is newest
    decay: torch.Tensor  # (H, 1): lambda, broadcast over channels


def step_tables(w: torch.Tensor, decay: torch.Tensor) -> StepTables:
    """The step's tables for a soft-capped w (H, s) and lambda (H,).

    Slot j of the ring buffer holds the token at distance (n - j) mod s from the newest token n. The
    bias weights exp(w) of every slot are then s consecutive entries of w's distances reversed and repeated,
    so one (2s, H) tensor and a view of its s + 1 windows serve every n: no table of s * s entries.
    """
    s = w.shape[1]
    reversed_twice = w.exp().flip(1).repeat(1, 2).T  # (2s, H): entry m is distance (s - 1 - m) mod s
    return StepTables(reversed_twice.unfold(0, s, 1).transpose(1, 2), decay[:, None])


def ring_slot(position: torch.Tensor, s: int) -> torch.Tensor:
    """Each row's window slot (B,) of its token at `position` (B,) (tensors: no host sync); 0 with no window."""
    return position % max(s, 1)


def _per_row(slots: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """slots (B, n) as an index into the window (B, s, H, D) along its slots: (B, n, H, D), for gather/scatter."""
    return slots[:, :, None, None].expand(-1, -1, *window.shape[2:])


def aft_step(q, k, v, tables: StepTables, state: MixerState) -> torch.Tensor:
    """y (B, H, D) of one more token, q, k, v (B, H, D), updating `state` in place: O(s D) work.

    k already soft-capped. The token leaving the window moves into the prefix. The positions stay a
    tensor and each row's slot is addressed with index_select / index_copy_, so there is no host sync and
    torch.compile can fuse the whole step.
    """
    s = tables.window_weight.shape[1]
    position = state["position"]  # (B,)
    slot = ring_slot(position, s)  # (B,)
    # The windows (B, s, H, D) seen as (B s, H, D), a view (so writes reach the state): row b's slot j is entry
    # b s + j, and each row's slot moves as one block (gather / scatter_ on the 4-d window took twice as long).
    win_exp_k, win_v = (state[name].view(-1, *state[name].shape[2:]) for name in ("window_exp_k", "window_v"))
    if s:  # an empty slot's exp(k) is 0: its key, -inf, weighs nothing below
        at_slot = torch.arange(0, position.shape[0] * s, s, device=position.device).add_(slot)  # (B,)
        leaving_k = win_exp_k.index_select(0, at_slot).log()  # (B, H, D)
        leaving_v = win_v.index_select(0, at_slot)
    else:
        leaving_k, leaving_v = k, v

    # Fold the leaving token (distance s: weight exp(k - lambda)) into the prefix, decaying the rest.
    a, b, p = state["prefix_num"], state["prefix_den"], state["prefix_max"]  # (B, H, D)
    top = torch.maximum(p, leaving_k)
    old_scale, new_scale = (p - top).exp_(), (leaving_k - top).exp_()
    a.mul_(old_scale).addcmul_(new_scale, leaving_v)
    b.mul_(old_scale).add_(new_scale)
    torch.sub(top, tables.decay, out=p)

    if s:
        win_exp_k.index_copy_(0, at_slot, k.exp())
        win_v.index_copy_(0, at_slot, v)
    y = latest_output(q, tables, state, slot)
    position.add_(1)
    return y


def latest_output(q: torch.Tensor, tables: StepTables, state: MixerState, newest_slot: torch.Tensor) -> torch.Tensor:
    """y (B, H, D) of each row's newest token, q (B, H, D), from a state that already holds it in `newest_slot` (B,).

    Its window holds the last s tokens, weighted exp(k + w[distance]), summed in slot order; its prefix
    everything older, exp(prefix_max) times the stored sums, already decayed to this token.
    """
    s = tables.window_weight.shape[1]
    a, b, p = state["prefix_num"], state["prefix_den"], state["prefix_max"]  # (B, H, D)
    if not s:
        return torch.sigmoid(q).mul_(a).div_(b)
    win_exp_k, win_v = state["window_exp_k"], state["window_v"]  # (B, s, H, D), in the ring's slots
    bias_weight = tables.window_weight.index_select(0, (s - 1) - newest_slot)  # (B, s, H): each slot's exp(w)
    weights = win_exp_k * bias_weight[..., None]  # (B, s, H, D): exp(k + w[distance])
    prefix_weight = p.exp()
    num = torch.linalg.vecdot(weights, win_v, dim=1).addcmul_(a, prefix_weight)
    den = weights.sum(dim=1).addcmul_(b, prefix_weight)
    return torch.sigmoid(q).mul_(num).div_(den)


def aft_parallel(
    q, k, v, w: torch.Tensor, decay: torch.Tensor, chunk: int = 32, state: MixerState | None = None,
    return_state: bool = False, last_only: bool = False,
) -> tuple[torch.Tensor, MixerState | None]:  # fmt: skip
    """y (B, T, H, D) of a whole sequence in the chunked form; k and w already soft-capped.

    With `state`, the sequence continues from it, and with `return_state` the state after the last
    token comes back, so long streams can be read chunk by chunk. `last_only` gives y of the last
    token alone (B, 1, H, D), read from that new state: reading a prompt needs no other.
    Gradients flow only when reading from nothing (training).
    """
    dtype = torch.promote_types(k.dtype, torch.float32)
    q, k, v, w, decay = (t.to(dtype) for t in (q, k, v, w, decay))
    if state is None and not return_state and not last_only:
        return aft_chunked(q, k, v, w, decay, chunk), None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, w, decay)):
        raise ValueError("aft_parallel: gradients through a carried state are not supported")
    B, T, H, D = k.shape
    s = w.shape[1]
    state = state if state is not None else empty_state(B, H, D, s, k.device)
    history = _unrolled(state, s)
    y, prefix = aft_chunked_from(q, k, v, w, decay, chunk, history, outputs=not last_only)
    new_state = _advanced(state, history, k, v, prefix)
    if last_only:
        newest_slot = ring_slot(new_state["position"] - 1, s)
        y = latest_output(q[:, T - 1], step_tables(w, decay), new_state, newest_slot)[:, None]
    return y, new_state if return_state else None


def _unrolled(state: MixerState, s: int) -> History:
    """Each row's ring buffer in time order, and its prefix as plain (not max-stabilised) sums."""
    position = state["position"]  # (B,): tensors, so no host sync and one compiled graph
    time_order = _per_row((torch.arange(s, device=position.device) + position[:, None]) % s, state["window_v"])
    scale = torch.exp(state["prefix_max"]).repeat(1, 1, 2)
    prefix = torch.cat([state["prefix_num"], state["prefix_den"]], dim=-1) * scale  # (B, H, 2D)
    keys = state["window_exp_k"].gather(1, time_order).log().clamp_min_(EMPTY_KEY)  # an empty slot: EMPTY_KEY
    return History(keys, state["window_v"].gather(1, time_order), prefix)


def _advanced(state: MixerState, history: History, k, v, prefix: torch.Tensor) -> MixerState:
    """The state after reading k, v (B, T, H, D): the last s keys and values, and `prefix` (B, H, 2D)."""
    s, T, D = history.keys.shape[1], k.shape[1], k.shape[-1]
    position = state["position"] + T  # (B,)
    newest = max(T - s, 0)  # the last s keys and values come from the old window and the new tokens
    keys = torch.cat([history.keys, k[:, newest:T]], dim=1)[:, T - newest :]  # (B, s, H, D), oldest first
    values = torch.cat([history.values, v[:, newest:T]], dim=1)[:, T - newest :]
    # Slot j of row b takes keys[b, (j - position[b]) mod s], so that its token g sits in slot g mod s.
    ring_order = _per_row((torch.arange(s, device=k.device) - position[:, None]) % s, values)  # (B, s, H, D)
    num = prefix[..., :D].contiguous()  # every tensor laid out as empty_state lays it out (the compiled step's)
    return {
        "window_exp_k": keys.gather(1, ring_order).exp(),
        "window_v": values.gather(1, ring_order),
        "prefix_num": num,
        "prefix_den": prefix[..., D:].contiguous(),
        "prefix_max": torch.zeros_like(num),
        "position": position,
    }


def focused_window_bias(n_head: int, window: int) -> torch.Tensor:
    """The initial w (H, s): head h favours the last few tokens, w[h, d] = (ln s + 1) exp(-d / tau_h).

    The paper starts w at 0, so every head first averages its whole window evenly; a language model
    needs heads that read the last token or two, and learning that from 0 takes most of a short run.
    Focus lengths tau go from s/2 down to half a token, so some heads stay broad. w stays >= 0,
    above the weight of everything beyond the window (<= 1).
    """
    if window == 0:
        return torch.zeros(n_head, 0)
    focus = torch.logspace(math.log10(window / 2), math.log10(0.5), n_head)[:, None]
    return (math.log(window) + 1) * torch.exp(-torch.arange(window)[None, :] / focus)


def full_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off: under mixed precision the exp/sum accumulations must still run in fp32. Nothing to
    switch where autocast is already off (entering a context at every layer of every step costs time)."""
    if not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


class AFTMixer(torch.nn.Module):
    """Multi-head causal AFT with window s: projections around `aft_parallel` / `aft_step`.

    s = config.window is AFT-local, s = 0 AFT-simple (decay only), s = the training length AFT-full.
    """

    no_weight_decay = ("w", "decay_logit")  # position biases and decays: not matrices to shrink
    fixed_size_state = True  # the last s keys and values, and the sums over everything older

    def __init__(self, n_embd: int, n_head: int, window: int, context_length: int, decay: bool, chunk: int = 32):
        super().__init__()
        self.n_head, self.head_dim, self.chunk = n_head, n_embd // n_head, chunk
        self.qkv = Linear(n_embd, 3 * n_embd)
        self.proj = Linear(n_embd, n_embd)
        self.w = torch.nn.Parameter(focused_window_bias(n_head, window))  # (H, s)
        # Heads start with horizons from about the training length down to the window, so some
        # look far back and some stay local; softplus keeps lambda >= 0.
        horizons = torch.logspace(math.log10(context_length), math.log10(max(window, 2) / 2), n_head)
        self.decay_logit = torch.nn.Parameter(torch.log(torch.expm1(1.0 / horizons)), requires_grad=decay)  # (H,)
        self.learn_decay = decay

    @classmethod
    def from_config(cls, config: MixerConfig) -> AFTMixer:
        field = WINDOW_FIELDS[config.mixer]
        window = getattr(config, field) if field else 0
        return cls(config.n_embd, config.n_head, window, config.context_length, config.decay)

    @classmethod
    def shaping_fields(cls, config: MixerConfig) -> tuple[str, ...]:
        field = WINDOW_FIELDS[config.mixer]
        return (field,) if field else ()

    @torch.no_grad()
    def perturb_(self) -> None:
        self.w.normal_(0, 1.0)
        self.decay_logit.normal_(-3, 1.0)

    def decay(self) -> torch.Tensor:
        """lambda (H,): 0 without a learned decay (the paper's AFT-local)."""
        if not self.learn_decay:
            return torch.zeros_like(self.decay_logit)
        return F.softplus(self.decay_logit)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.n_head, self.head_dim)).unbind(-3)
        return q, soft_cap(k.float()), v

    def initial_state(self, batch_size: int, device=None) -> MixerState:
        return empty_state(batch_size, self.n_head, self.head_dim, self.w.shape[1], device)

    def forward(
        self, x: torch.Tensor, state: MixerState | None = None, return_state: bool = False, last_only: bool = False
    ) -> tuple[torch.Tensor, MixerState | None]:
        q, k, v = self._qkv(x)  # (B, T, H, D)
        with full_precision(x.device):
            w, decay = soft_cap(self.w), self.decay()
            y, state = aft_parallel(q, k, v, w, decay, self.chunk, state, return_state, last_only)
        return self.proj(y.to(x.dtype).flatten(-2)), state

    def step(self, x: torch.Tensor, state: MixerState) -> torch.Tensor:
        q, k, v = self._qkv(x)  # (B, H, D)
        with full_precision(x.device):
            y = aft_step(q.float(), k, v.float(), self.step_tables(), state)
        return self.proj(y.to(x.dtype).flatten(-2))

    def step_tables(self) -> StepTables:
        """The step's tables of w and the decay: derived at every step inside a compiled step (where that is
        fused and free), else once per change of the parameters (an optimizer step, a load, a move)."""
        if torch.compiler.is_compiling():
            return step_tables(soft_cap(self.w), self.decay())
        version = (self.w._version, self.decay_logit._version, self.w.data_ptr(), self.decay_logit.data_ptr())
        if getattr(self, "_tables_version", None) != version:
            with torch.no_grad():  # the step is for inference: no gradient flows through these
                self._tables = step_tables(soft_cap(self.w), self.decay())
            self._tables_version = version
        return self._tables
