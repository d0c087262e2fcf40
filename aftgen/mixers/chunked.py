"""The chunked parallel form of causal AFT: the formula in aft.py over a whole sequence at once.

Cost O(T C D) time and O(T D) memory for chunks of C tokens; no T x T tensor and no subtraction
that could cancel. Position i of chunk n sees three groups of tokens:

- its own chunk, tokens j <= i: a C x C lower-triangular matmul with weights exp(b[i - j]);
- the whole chunk before: a C x C matmul with weights exp(b[C + i - j]) (it holds the window, C >= s);
- everything older: a decayed running sum S_n (the recurrent state's prefix at a chunk boundary),
  weighted exp(-lambda (i + 1 + C - s)). S over all chunks is one small (N x N) matmul with
  weights exp(-lambda C (n - 1 - m)).

Layout: exp(k) v and exp(k) sit side by side as `blocks` (H, C, N + 1, B, 2D), where row j of block
n' is time (n' - 1) C + j and block 0 holds the history before the sequence (zeros when there is
none). In this layout every matmul above is one strided bmm over all chunks and sequences at once
(batch = heads), with no permute between them.

On CUDA, aft_chunked runs the same form as two fused Triton kernels instead (fused.py; KERNEL_VARIABLE).

Letters: B batch, T time, H heads, D channels per head, s window, C chunk length, N chunks.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aftgen.errors import AftgenError

EMPTY_KEY = -1e4  # the key of a token that weighs nothing: exp(EMPTY_KEY - m) == 0 for any m in range
MATRICES = ("current", "previous", "into", "entry", "carry")
# Which form aft_chunked runs: "auto" the fused Triton kernels (fused.py) on CUDA where they are available
# and this PyTorch form elsewhere, "triton" or "torch" one of them wherever the kernels apply.
KERNEL_VARIABLE = "AFTGEN_MIXER_KERNEL"
KERNEL_CHOICES = ("auto", "triton", "torch")
KERNEL_CHUNKS = (16, 32, 64)  # powers of two tl.dot takes, the longest two C x C matrices that fit in registers
# The kernels need Triton, and torch.library.triton_op (torch >= 2.6).
KERNELS_AVAILABLE = importlib.util.find_spec("triton") is not None and hasattr(torch.library, "triton_op")


@dataclass
class History:
    """What a sequence continues from, in time order (aft.py keeps it as a ring buffer)."""

    keys: torch.Tensor  # (B, s, H, D): the window, oldest first
    values: torch.Tensor  # (B, s, H, D)
    prefix: torch.Tensor  # (B, H, 2D): sums of exp(k) v and exp(k) over everything older, decayed to now


def relative_weights(w: torch.Tensor, decay: torch.Tensor, length: int) -> torch.Tensor:
    """exp(b[h, d]) for 0 <= d < length (H, length): exp(w) inside the window, exp(-lambda (d - s + 1)) beyond."""
    window = w.shape[1]
    d = torch.arange(length, device=decay.device)
    beyond = torch.exp(-decay[:, None] * (d - window + 1).clamp(min=0))
    if window == 0:
        return beyond
    inside = F.pad(torch.exp(w), (0, max(length - window, 0)))[:, :length]
    return torch.where(d < window, inside, beyond)


def block_weights(w: torch.Tensor, decay: torch.Tensor, C: int, N: int, history: bool) -> dict[str, torch.Tensor]:
    """The small matrices of the chunked form, built with autograd so gradients reach w and decay.

    "current" and "previous" (H, C, C) read a chunk and the block before it; the decayed sum of
    everything older, S_n = sum_m carry[n, m] (entry . block m), reaches position i through "into".
    """
    s, device = w.shape[1], decay.device
    weights = relative_weights(w, decay, 2 * C)  # (H, 2C): every distance the two blocks can hold
    i = torch.arange(C, device=device)
    gap = i[:, None] - i[None, :]  # (C, C): i - j
    mats = {"current": weights[:, gap.clamp(min=0)] * (gap >= 0)}  # (H, C, C)
    if N > 1 or history:
        mats["previous"] = weights[:, C + gap]  # (H, C, C)
    lam = decay[:, None]  # (H, 1)
    if N > 1:
        a = torch.arange(N - 1, device=device)
        lag = a[:, None] - a[None, :]  # (N-1, N-1)
        mats["into"] = torch.exp(-lam * (i + 1 + C - s))[:, :, None]  # (H, C, 1)
        mats["entry"] = torch.exp(-lam * (C - i))[:, None, :]  # (H, 1, C)
        mats["carry"] = torch.exp(-lam[:, :, None] * C * lag.clamp(min=0)) * (lag >= 0)  # (H, N-1, N-1)
    return mats


def to_blocks(k: torch.Tensor, v: torch.Tensor, C: int, history: History | None) -> torch.Tensor:
    """exp(k) v and exp(k) of k, v (B, T, H, D) laid out as blocks (H, C, N + 1, B, 2D)."""
    B, T, H, D = k.shape
    blocks = k.new_empty(H, C, T // C + 1, B, 2 * D)
    e = torch.exp(k)  # (B, T, H, D)
    # One contiguous pass, then one permuting copy (writing exp straight into the strided layout is slower).
    pairs = torch.cat([e * v, e], dim=-1).view(B, T // C, C, H, 2 * D)
    blocks[:, :, 1:].permute(3, 2, 1, 0, 4).copy_(pairs)
    blocks[:, :, 0].zero_()
    if history is not None and history.keys.shape[1]:
        window_e = torch.exp(history.keys)  # (B, s, H, D)
        s = window_e.shape[1]
        window_pairs = torch.cat([window_e * history.values, window_e], dim=-1)  # (B, s, H, 2D)
        blocks[:, C - s :, 0].permute(2, 1, 0, 3).copy_(window_pairs)
    return blocks


def mix_blocks(blocks: torch.Tensor, mats: dict[str, torch.Tensor], prefix0: torch.Tensor | None) -> torch.Tensor:
    """Numerator and denominator sums (H, C, N, B, 2D), chunk n at [:, :, n]; prefix0 (H, B 2D) is the history's."""
    H, C, N1, B, D2 = blocks.shape
    N, width = N1 - 1, B * D2
    flat = blocks.view(H, C, N1 * width)
    out = torch.bmm(mats["current"], flat[:, :, width:])  # (H, C, N width)
    first = 0 if prefix0 is not None else 1  # with no history the first chunk has nothing before it
    if N > first:
        out[:, :, first * width :].baddbmm_(mats["previous"], flat[:, :, first * width : N * width])
    if N > 1:
        per_block = torch.bmm(mats["entry"], flat[:, :, : (N - 1) * width]).view(H, N - 1, width)
        older = torch.bmm(mats["carry"], per_block)  # (H, N-1, width): S_n for chunks 1 .. N-1
        if prefix0 is not None:
            older += mats["from_start"] * prefix0[:, None]
        out[:, :, width:].baddbmm_(mats["into"], older.view(H, 1, (N - 1) * width))
    if prefix0 is not None:
        out[:, :, :width].baddbmm_(mats["into_first"], prefix0[:, None])
    return out.view(H, C, N, B, D2)


def readout(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """y = sigmoid(q) * num / den (B, T, H, D), from q (B, T, H, D) and the sums out (H, C, N, B, 2D)."""
    H, C, N, B, D2 = out.shape
    by_time = out.permute(3, 2, 1, 0, 4)  # (B, N, C, H, 2D)
    y = torch.sigmoid(q)
    y.view(B, N, C, H, D2 // 2).mul_(by_time[..., : D2 // 2]).div_(by_time[..., D2 // 2 :])
    return y


class ChunkedAFT(torch.autograd.Function):
    """The chunked form with no history, with a hand-written backward.

    Autograd through the block matmuls would keep every intermediate; this keeps the blocks and the
    sums and runs the backward as the same strided bmms, transposed.
    """

    @staticmethod
    def forward(ctx, q, k, v, current, previous, into, entry, carry):
        mats = {"current": current, "previous": previous, "into": into, "entry": entry, "carry": carry}
        blocks = to_blocks(k, v, current.shape[-1], None)  # (H, C, N + 1, B, 2D)
        out = mix_blocks(blocks, mats, None)  # (H, C, N, B, 2D)
        ctx.save_for_backward(q, v, blocks, out, current, previous, into, entry, carry)
        return readout(q, out)

    @staticmethod
    def backward(ctx, grad_y):
        q, v, blocks, out, current, previous, into, entry, carry = ctx.saved_tensors
        grad_q, grad_out = _readout_backward(grad_y, q, out)
        grad_blocks, grads = _mix_backward(grad_out, blocks, current, previous, into, entry, carry)
        grad_k, grad_v = _blocks_backward(grad_blocks, blocks, v)
        return grad_q, grad_k, grad_v, *(grads.get(name) for name in MATRICES)


def _readout_backward(grad_y: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of y = g num / den, g = sigmoid(q): dq (B, T, H, D) and d(num, den) (H, C, N, B, 2D).

    d num = dy g / den, d den = -d num num / den, dq = d num num (1 - g); each written once, in the
    strided (B, N, C, H, .) views of the sums.
    """
    H, C, N, B, D2 = out.shape
    D = D2 // 2
    by_time = out.permute(3, 2, 1, 0, 4)  # (B, N, C, H, 2D)
    num, den = by_time[..., :D], by_time[..., D:]
    gate = torch.sigmoid(q).view(B, N, C, H, D)
    grad_out = torch.empty_like(out)  # (H, C, N, B, 2D)
    grad_sums = grad_out.permute(3, 2, 1, 0, 4)  # (B, N, C, H, 2D)
    grad_num, grad_den = grad_sums[..., :D], grad_sums[..., D:]
    torch.div(grad_y.reshape(B, N, C, H, D) * gate, den, out=grad_num)
    scaled = torch.mul(grad_num, num, out=torch.empty_like(gate))  # in gate's (time-major) layout
    torch.div(scaled, den, out=grad_den).neg_()
    grad_q = torch.addcmul(scaled, scaled, gate, value=-1).view(B, N * C, H, D)
    return grad_q, grad_out


def _mix_backward(grad_out, blocks, current, previous, into, entry, carry) -> tuple[torch.Tensor, dict]:
    """Gradients of mix_blocks (no history): d blocks 1..N as (H, C, N width), and of each matrix."""
    H, C, N1, B, D2 = blocks.shape
    N, width = N1 - 1, B * D2
    G, flat = grad_out.view(H, C, N * width), blocks.view(H, C, N1 * width)
    grad_blocks = torch.bmm(current.transpose(1, 2), G)  # (H, C, N width); chunk n here is block n + 1
    grads = {"current": torch.bmm(G, flat[:, :, width:].transpose(1, 2))}  # (H, C, C)
    if N == 1:
        return grad_blocks, grads
    grad_blocks[:, :, : (N - 1) * width].baddbmm_(previous.transpose(1, 2), G[:, :, width:])
    grads["previous"] = torch.bmm(G[:, :, width:], flat[:, :, width : N * width].transpose(1, 2))  # (H, C, C)
    per_block = torch.bmm(entry, flat[:, :, : (N - 1) * width]).view(H, N - 1, width)
    older = torch.bmm(carry, per_block)  # (H, N-1, width)
    grad_older = torch.bmm(into.transpose(1, 2), G[:, :, width:]).view(H, N - 1, width)
    grad_per_block = torch.bmm(carry.transpose(1, 2), grad_older)  # (H, N-1, width)
    if N > 2:  # block 0 is the (empty) history: only blocks 1 .. N-2 feed later chunks
        fed = grad_per_block[:, 1:].reshape(H, 1, (N - 2) * width)
        grad_blocks[:, :, : (N - 2) * width].baddbmm_(entry.transpose(1, 2), fed)
    grads["into"] = torch.bmm(G[:, :, width:], older.view(H, (N - 1) * width, 1))  # (H, C, 1)
    flat_older_blocks = flat[:, :, : (N - 1) * width].transpose(1, 2)  # (H, (N-1) width, C)
    grads["entry"] = torch.bmm(grad_per_block.view(H, 1, (N - 1) * width), flat_older_blocks)  # (H, 1, C)
    grads["carry"] = torch.bmm(grad_older, per_block.transpose(1, 2))  # (H, N-1, N-1)
    return grad_blocks, grads


def _blocks_backward(grad_blocks: torch.Tensor, blocks: torch.Tensor, v: torch.Tensor):
    """Gradients of z = (e v, e), e = exp(k): dv = dz_num e, dk = dv v + dz_den e, each (B, T, H, D).

    Written into fresh (B, T, H, D) tensors: a product of these strided views would keep their
    layout and cost another pass to make contiguous.
    """
    H, C, N1, B, D2 = blocks.shape
    N, D = N1 - 1, D2 // 2
    gz = grad_blocks.view(H, C, N, B, D2).permute(3, 2, 1, 0, 4)  # (B, N, C, H, 2D)
    e = blocks[:, :, 1:].permute(3, 2, 1, 0, 4)[..., D:]  # (B, N, C, H, D)
    grad_v = torch.mul(gz[..., :D], e, out=v.new_empty(B, N, C, H, D))
    grad_k = torch.mul(gz[..., D:], e, out=v.new_empty(B, N, C, H, D)).addcmul_(grad_v, v.view(B, N, C, H, D))
    return grad_k.view(B, N * C, H, D), grad_v.view(B, N * C, H, D)


def _pad_to_chunks(q, k, v, C: int):
    """Pad (B, T, H, D) inputs to whole chunks with tokens that weigh nothing (exp(EMPTY_KEY) == 0)."""
    T = k.shape[1]
    missing = math.ceil(T / C) * C - T
    if not missing:
        return q, k, v
    pad = (0, 0, 0, 0, 0, missing)
    return F.pad(q, pad), F.pad(k, pad, value=EMPTY_KEY), F.pad(v, pad)


def chunk_length(chunk: int, window: int) -> int:
    """C: at least the window, so the block before a chunk holds the whole window."""
    return max(chunk, window, 1)


def kernel_chunk(C: int) -> int | None:
    """The fused kernels' chunk length for chunks of C: the shortest of KERNEL_CHUNKS >= C (any length
    >= the window computes the same function), or None where the window is too long for them."""
    return next((length for length in KERNEL_CHUNKS if length >= C), None)


def kernel_weights(w: torch.Tensor, decay: torch.Tensor, C: int) -> list[torch.Tensor]:
    """The fused kernels' weights, built with autograd as block_weights builds them: current, previous
    (H, C, C), into, entry (H, C) and gamma (H,), the carried sum's decay over one chunk."""
    H = w.shape[0]
    mats = block_weights(w, decay, C, 2, history=False)  # N=2: every matrix a chunk after the first reads
    into, entry = mats["into"].reshape(H, C), mats["entry"].reshape(H, C)
    return [mats["current"], mats["previous"], into, entry, torch.exp(-decay * C)]


def use_kernel(device: torch.device, C: int) -> bool:
    """Whether aft_chunked runs the fused Triton kernels for chunks of C on `device` (KERNEL_VARIABLE says)."""
    choice = os.environ.get(KERNEL_VARIABLE, "auto")
    if choice not in KERNEL_CHOICES:
        raise AftgenError(f"{KERNEL_VARIABLE}={choice!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    if choice == "triton" and not KERNELS_AVAILABLE:
        raise AftgenError(f"{KERNEL_VARIABLE}=triton needs Triton and torch >= 2.6: pip install triton, or unset it")
    if choice == "torch" or kernel_chunk(C) is None:
        return False
    return choice == "triton" or (device.type == "cuda" and KERNELS_AVAILABLE)


def aft_chunked(q, k, v, w: torch.Tensor, decay: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """y (B, T, H, D) of a sequence read from nothing; q, k, v (B, T, H, D), k and w already soft-capped.

    The training path: gradients run through ChunkedAFT's hand-written backward, or the fused kernels'.
    """
    T = k.shape[1]
    C = chunk_length(chunk, w.shape[1])
    if use_kernel(q.device, C):
        from aftgen.mixers.fused import aft_fused  # imports Triton: only where the kernels run

        return aft_fused(q, k, v, *kernel_weights(w, decay, kernel_chunk(C)))
    q, k, v = _pad_to_chunks(q, k, v, C)
    mats = block_weights(w, decay, C, k.shape[1] // C, history=False)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, w, decay)):
        y = ChunkedAFT.apply(q, k, v, *(mats.get(name) for name in MATRICES))
    else:
        y = readout(q, mix_blocks(to_blocks(k, v, C, None), mats, None))
    return y[:, :T]


def aft_chunked_from(
    q, k, v, w: torch.Tensor, decay: torch.Tensor, chunk: int, history: History, outputs: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Continue `history` with q, k, v (B, T, H, D): y (B, T, H, D) (None unless `outputs`) and the
    prefix (B, H, 2D) after the last token: every token older than the last s, decayed to time T.

    No gradients: reading prompts and streams only.
    """
    B, T, H, D = k.shape
    s = w.shape[1]
    C = chunk_length(chunk, s)
    q, k, v = _pad_to_chunks(q, k, v, C)
    N = k.shape[1] // C
    prefix0 = history.prefix.transpose(0, 1).reshape(H, B * 2 * D)  # (H, B 2D)
    blocks = to_blocks(k, v, C, history)  # (H, C, N + 1, B, 2D)
    y = None
    if outputs:
        y = readout(q, mix_blocks(blocks, _history_weights(w, decay, C, N), prefix0))[:, :T]
    i = torch.arange(C, device=k.device)
    time = (torch.arange(N + 1, device=k.device)[None, :] - 1) * C + i[:, None]  # of each block row (C, N + 1)
    age = T - s - time  # how far before the new window each row's token lies
    kept = (age >= 1) & (time >= -s)  # block 0 holds real tokens only in its last s rows
    fold = torch.where(kept, torch.exp(-decay[:, None, None] * age.clamp(min=0)), 0.0)  # (H, C, N + 1)
    older = torch.exp(-decay * T)[None, :, None] * history.prefix  # (B, H, 2D)
    return y, torch.einsum("hjn,hjnbd->bhd", fold, blocks) + older


def _history_weights(w: torch.Tensor, decay: torch.Tensor, C: int, N: int) -> dict[str, torch.Tensor]:
    """block_weights plus how the history's prefix reaches chunk 0 ("into_first") and later ones."""
    s, lam = w.shape[1], decay[:, None]
    mats = block_weights(w, decay, C, N, history=True)
    mats["into_first"] = torch.exp(-lam * (torch.arange(C, device=decay.device) + 1))[:, :, None]  # (H, C, 1)
    if N > 1:
        starts = torch.arange(N - 1, device=decay.device) * C + s
        mats["from_start"] = torch.exp(-lam * starts)[:, :, None]  # (H, N-1, 1)
    return mats
