"""The chunked form of chunked.py as two fused Triton kernels: one forward, one backward.

Each program owns one (sequence, head, block of channels) and walks its chunks in order, as the
recurrent form walks tokens: per chunk one load of k and v, exp(k) in registers, tl.dot of the
chunk's C x C weight matrices against the current and the previous block (numerator and denominator
alike), the decayed sum of everything older carried in fp32 registers, and sigmoid(q) num / den
written out. Nothing of size T x C and no intermediate sums ever reach memory.

The backward walks the chunks in reverse. It needs the carried sum S_n at every chunk boundary; the
forward kernel, run a second time with its outputs switched off, writes just those (B, H, N, 2, D),
so the forward saves nothing beyond its inputs. The gradients of the small weight matrices are
summed per program and then over programs here; autograd carries them to w and lambda through
chunked.kernel_weights, built by the same construction the PyTorch form differentiates.

Both kernels are torch.library ops (triton_op), so torch.compile traces through them. In Triton's
interpreter (TRITON_INTERPRET=1) they run on CPU tensors: that is how the tests check them.

Letters as in chunked.py: B batch, T time, H heads, D channels per head, C chunk length, N chunks.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from aftgen.errors import AftgenError

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Channels per program: tl.dot's smallest block (chunks are at least this long too: chunked.KERNEL_CHUNKS).
# The smallest, for the most programs: each walks its chunks in turn, so at batch 1 and long T only
# B H D / CHANNEL_BLOCK programs fill the GPU.
CHANNEL_BLOCK = 16


@triton.jit
def _load(base, t, c, stride_t, mask):
    """Rows t, channels c of one (sequence, head) of a (B, T, H, D) tensor, as fp32; 0 where masked."""
    return tl.load(base + t[:, None] * stride_t + c[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _block(k, v, t, c, k_t, v_t, T, D):
    """(exp(k) v, exp(k)) of tokens t (C, BD): zero for tokens outside 0 <= t < T, which weigh nothing."""
    mask = ((t >= 0) & (t < T))[:, None] & (c < D)[None, :]
    e = tl.where(mask, tl.exp(_load(k, t, c, k_t, mask)), 0.0)
    return e * _load(v, t, c, v_t, mask), e


@triton.jit
def _head_weights(current, previous, into, entry, gamma, h, C: tl.constexpr):
    """Head h's chunk weights: current and previous (C, C), into and entry (C,), gamma (a number)."""
    i = tl.arange(0, C)
    cur = tl.load(current + h * C * C + i[:, None] * C + i[None, :])
    prev = tl.load(previous + h * C * C + i[:, None] * C + i[None, :])
    return cur, prev, tl.load(into + h * C + i), tl.load(entry + h * C + i), tl.load(gamma + h)


@triton.jit
def _chunk_sums(cur, prev, ev, e, ev_prev, e_prev, reach, s_num, s_den, mask, PRECISION: tl.constexpr):
    """A chunk's (num, den) (C, BD): its block and the one before through the weight matrices, plus the carried
    sums S_n; den is 1 where masked, so that num / den stays finite there."""
    num = tl.dot(cur, ev, input_precision=PRECISION) + tl.dot(prev, ev_prev, input_precision=PRECISION)
    den = tl.dot(cur, e, input_precision=PRECISION) + tl.dot(prev, e_prev, input_precision=PRECISION)
    num += reach[:, None] * s_num[None, :]
    return num, tl.where(mask, den + reach[:, None] * s_den[None, :], 1.0)


@triton.jit
def _forward_kernel(
    q, k, v, y, states, current, previous, into, entry, gamma,
    q_b, q_t, q_h, k_b, k_t, k_h, v_b, v_t, v_h, y_b, y_t, y_h,
    T, H, D, N,
    C: tl.constexpr, BD: tl.constexpr, WRITE_Y: tl.constexpr, WRITE_STATES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """y (B, T, H, D) and/or the carried sums S_n (B, H, N, 2, D) before each chunk n."""
    d_block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    q, k, v, y = q + b * q_b + h * q_h, k + b * k_b + h * k_h, v + b * v_b + h * v_h, y + b * y_b + h * y_h
    states += (b * H + h) * N * 2 * D
    i = tl.arange(0, C)
    c = d_block * BD + tl.arange(0, BD)
    cur, prev, reach, enter, fade = _head_weights(current, previous, into, entry, gamma, h, C)
    s_num, s_den = tl.zeros((BD,), tl.float32), tl.zeros((BD,), tl.float32)
    ev_prev, e_prev = tl.zeros((C, BD), tl.float32), tl.zeros((C, BD), tl.float32)
    for n in range(N):
        t = n * C + i
        ev, e = _block(k, v, t, c, k_t, v_t, T, D)
        if WRITE_STATES:
            tl.store(states + n * 2 * D + c, s_num, mask=c < D)
            tl.store(states + n * 2 * D + D + c, s_den, mask=c < D)
        if WRITE_Y:
            mask = (t < T)[:, None] & (c < D)[None, :]
            num, den = _chunk_sums(cur, prev, ev, e, ev_prev, e_prev, reach, s_num, s_den, mask, PRECISION)
            out = tl.where(mask, tl.sigmoid(_load(q, t, c, q_t, mask)) * num / den, 0.0)  # rows past T: unwritten
            tl.store(y + t[:, None] * y_t + c[None, :], out.to(y.dtype.element_ty), mask=mask)
        # S_{n+1} = gamma S_n + entry . block n-1: the block before this chunk leaves the window's reach.
        s_num = fade * s_num + tl.sum(enter[:, None] * ev_prev, axis=0)
        s_den = fade * s_den + tl.sum(enter[:, None] * e_prev, axis=0)
        ev_prev, e_prev = ev, e


@triton.jit
def _block_grad(cur, prev, enter, d_out, d_out_next, g2, PRECISION: tl.constexpr):
    """dL/d(block n's sums) (C, BD), num's or den's: through chunk n (current), chunk n+1 (previous) and, once
    it has left the window, S_{n+2} (entry)."""
    grad = tl.dot(tl.trans(cur), d_out, input_precision=PRECISION)
    grad += tl.dot(tl.trans(prev), d_out_next, input_precision=PRECISION)
    return grad + enter[:, None] * g2[None, :]


@triton.jit
def _store_head_grads(
    grad_current, grad_previous, grad_into, grad_entry, grad_gamma, share, d_cur, d_prev, d_reach, d_enter, d_fade,
    C: tl.constexpr,
):  # fmt: skip
    """Row `share` of the per-program sums of the head weights' gradients (the inverse of _head_weights)."""
    i = tl.arange(0, C)
    tl.store(grad_current + share * C * C + i[:, None] * C + i[None, :], d_cur)
    tl.store(grad_previous + share * C * C + i[:, None] * C + i[None, :], d_prev)
    tl.store(grad_into + share * C + i, d_reach)
    tl.store(grad_entry + share * C + i, d_enter)
    tl.store(grad_gamma + share, d_fade)


@triton.jit
def _backward_kernel(
    q, k, v, grad_y, states, current, previous, into, entry, gamma,
    grad_q, grad_k, grad_v, grad_current, grad_previous, grad_into, grad_entry, grad_gamma,
    q_b, q_t, q_h, k_b, k_t, k_h, v_b, v_t, v_h, g_b, g_t, g_h, o_b, o_t, o_h,
    T, H, D, N,
    C: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dq, dk, dv (B, T, H, D) in the layout o_*, and this program's share of the weights' gradients.

    Chunk n's sums are recomputed from its block, the one before and S_n. With G_n = dL/dS_n
    (G_n = into . dOut_n + gamma G_{n+1}), block n's gradient is
    current^T dOut_n + previous^T dOut_{n+1} + entry G_{n+2}: the walk keeps dOut_{n+1}, G_{n+1}, G_{n+2}.
    """
    d_block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    q, k, v, grad_y = q + b * q_b + h * q_h, k + b * k_b + h * k_h, v + b * v_b + h * v_h, grad_y + b * g_b + h * g_h
    grad_q, grad_k, grad_v = grad_q + b * o_b + h * o_h, grad_k + b * o_b + h * o_h, grad_v + b * o_b + h * o_h
    states += (b * H + h) * N * 2 * D
    i = tl.arange(0, C)
    c = d_block * BD + tl.arange(0, BD)
    cur, prev, reach, enter, fade = _head_weights(current, previous, into, entry, gamma, h, C)
    d_cur, d_prev = tl.zeros((C, C), tl.float32), tl.zeros((C, C), tl.float32)
    d_reach, d_enter = tl.zeros((C,), tl.float32), tl.zeros((C,), tl.float32)
    d_fade = tl.zeros((BD,), tl.float32)
    g1_num, g1_den = tl.zeros((BD,), tl.float32), tl.zeros((BD,), tl.float32)  # G_{n+1}
    g2_num, g2_den = tl.zeros((BD,), tl.float32), tl.zeros((BD,), tl.float32)  # G_{n+2}
    dnum_next, dden_next = tl.zeros((C, BD), tl.float32), tl.zeros((C, BD), tl.float32)  # dOut_{n+1}
    ev, e = _block(k, v, (N - 1) * C + i, c, k_t, v_t, T, D)  # block n, read as block n-1 one step before
    for step in range(N):
        n = N - 1 - step
        t = n * C + i
        ev_prev, e_prev = _block(k, v, t - C, c, k_t, v_t, T, D)
        s_num = tl.load(states + n * 2 * D + c, mask=c < D, other=0.0)
        s_den = tl.load(states + n * 2 * D + D + c, mask=c < D, other=0.0)
        mask = (t < T)[:, None] & (c < D)[None, :]
        num, den = _chunk_sums(cur, prev, ev, e, ev_prev, e_prev, reach, s_num, s_den, mask, PRECISION)
        gate = tl.sigmoid(_load(q, t, c, q_t, mask))
        # y = gate num / den: d num = dy gate / den, d den = -d num num / den, dq = d num num (1 - gate).
        dnum = _load(grad_y, t, c, g_t, mask) * gate / den
        dden = -dnum * num / den
        at = t[:, None] * o_t + c[None, :]
        tl.store(grad_q + at, (dnum * num * (1 - gate)).to(grad_q.dtype.element_ty), mask=mask)

        d_cur += tl.dot(dnum, tl.trans(ev), input_precision=PRECISION)
        d_cur += tl.dot(dden, tl.trans(e), input_precision=PRECISION)
        d_prev += tl.dot(dnum, tl.trans(ev_prev), input_precision=PRECISION)
        d_prev += tl.dot(dden, tl.trans(e_prev), input_precision=PRECISION)
        d_reach += tl.sum(dnum * s_num[None, :] + dden * s_den[None, :], axis=1)
        g_num = tl.sum(reach[:, None] * dnum, axis=0) + fade * g1_num  # G_n
        g_den = tl.sum(reach[:, None] * dden, axis=0) + fade * g1_den
        d_fade += g1_num * s_num + g1_den * s_den  # S_{n+1} = gamma S_n + ...
        d_enter += tl.sum(g2_num[None, :] * ev + g2_den[None, :] * e, axis=1)  # S_{n+2} = ... + entry . block n

        dz_num = _block_grad(cur, prev, enter, dnum, dnum_next, g2_num, PRECISION)
        dz_den = _block_grad(cur, prev, enter, dden, dden_next, g2_den, PRECISION)
        # z = (e v, e), e = exp(k): dv = dz_num e, dk = dz_num e v + dz_den e.
        tl.store(grad_v + at, (dz_num * e).to(grad_v.dtype.element_ty), mask=mask)
        tl.store(grad_k + at, (dz_num * ev + dz_den * e).to(grad_k.dtype.element_ty), mask=mask)

        g2_num, g2_den, g1_num, g1_den = g1_num, g1_den, g_num, g_den
        dnum_next, dden_next = dnum, dden
        ev, e = ev_prev, e_prev

    share = (b * tl.num_programs(0) + d_block) * H + h  # this program's row of the per-program sums
    _store_head_grads(grad_current, grad_previous, grad_into, grad_entry, grad_gamma, share,
                      d_cur, d_prev, d_reach, d_enter, tl.sum(d_fade, axis=0), C)  # fmt: skip


def _launch_shape(q: torch.Tensor, current: torch.Tensor) -> tuple[int, tuple[int, int]]:
    """The number of chunks and the grid (channel blocks, B H) for q (B, T, H, D)."""
    B, T, H, D = q.shape
    return triton.cdiv(T, current.shape[-1]), (triton.cdiv(D, CHANNEL_BLOCK), B * H)


def _precision() -> str:
    """tf32 where PyTorch's own fp32 matmuls may use it (aftgen allows it on GPUs), else exact fp32."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 and not INTERPRETING else "ieee"


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along channels, the one layout the kernels assume (q and v are views of one qkv)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _weights(*mats: torch.Tensor) -> list[torch.Tensor]:
    return [m.float().contiguous() for m in mats]


def carried_sums(q, k, v, *weights: torch.Tensor) -> torch.Tensor:
    """S_n before every chunk n (B, H, N, 2, D), fp32: the decayed sums of exp(k) v and exp(k) over every
    token before chunk n - 1, decayed to the end of that chunk. The forward kernel with its outputs off."""
    q, k, v = _rows(q), _rows(k), _rows(v)
    weights = _weights(*weights)
    B, T, H, D = q.shape
    N, grid = _launch_shape(q, weights[0])
    states = q.new_empty(B, H, N, 2, D, dtype=torch.float32)
    wrap_triton(_forward_kernel)[grid](
        q, k, v, q, states, *weights, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *q.stride()[:3],
        T, H, D, N, C=weights[0].shape[-1], BD=CHANNEL_BLOCK, WRITE_Y=False, WRITE_STATES=True, PRECISION=_precision(),
    )  # fmt: skip
    return states


@triton_op("aftgen::aft_local_forward", mutates_args=())
def aft_local_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, current: torch.Tensor, previous: torch.Tensor,
    into: torch.Tensor, entry: torch.Tensor, gamma: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """y (B, T, H, D) from q, k, v (B, T, H, D) and chunked.kernel_weights: current and
    previous (H, C, C), into and entry (H, C), gamma = exp(-lambda C) (H,)."""
    q, k, v = _rows(q), _rows(k), _rows(v)
    weights = _weights(current, previous, into, entry, gamma)
    B, T, H, D = q.shape
    N, grid = _launch_shape(q, current)
    y = q.new_empty(B, T, H, D)
    wrap_triton(_forward_kernel)[grid](
        q, k, v, y, y, *weights, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *y.stride()[:3],
        T, H, D, N, C=current.shape[-1], BD=CHANNEL_BLOCK, WRITE_Y=True, WRITE_STATES=False, PRECISION=_precision(),
    )  # fmt: skip
    return y


@triton_op("aftgen::aft_local_backward", mutates_args=())
def aft_local_backward(
    grad_y: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, current: torch.Tensor,
    previous: torch.Tensor, into: torch.Tensor, entry: torch.Tensor, gamma: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:  # fmt: skip
    """The gradients of aft_local_forward's output `grad_y` with respect to each of its eight inputs."""
    grad_y, q, k, v = _rows(grad_y), _rows(q), _rows(k), _rows(v)
    weights = _weights(current, previous, into, entry, gamma)
    B, T, H, D = q.shape
    C = current.shape[-1]
    N, grid = _launch_shape(q, current)
    states = carried_sums(q, k, v, *weights)
    grad_q, grad_k, grad_v = (x.new_empty(B, T, H, D) for x in (q, k, v))
    programs = grid[0] * B  # every (sequence, channel block) adds its share to the weights' gradients
    shares = [q.new_empty(programs, H, *shape, dtype=torch.float32) for shape in ((C, C), (C, C), (C,), (C,), ())]
    wrap_triton(_backward_kernel)[grid](
        q, k, v, grad_y, states, *weights, grad_q, grad_k, grad_v, *shares,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_y.stride()[:3], *grad_q.stride()[:3],
        T, H, D, N, C=C, BD=CHANNEL_BLOCK, PRECISION=_precision(),
    )  # fmt: skip
    sums = [share.sum(0).to(m.dtype) for share, m in zip(shares, (current, previous, into, entry, gamma), strict=True)]
    return grad_q, grad_k, grad_v, *sums


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_y):
    return aft_local_backward(grad_y, *ctx.saved_tensors)


aft_local_forward.register_autograd(_backward, setup_context=_save_inputs)


def aft_fused(q, k, v, *weights: torch.Tensor) -> torch.Tensor:
    """chunked.aft_chunked's y (B, T, H, D) from the fused kernels, gradients included, for
    chunked.kernel_weights (whose chunk length must be a power of two, at least 16)."""
    if not (q.is_cuda or INTERPRETING):
        raise AftgenError(
            f"the fused AFT kernels run on CUDA (or under TRITON_INTERPRET=1), not on {q.device.type}: "
            "unset AFTGEN_MIXER_KERNEL"
        )
    return aft_local_forward(q, k, v, *weights)
