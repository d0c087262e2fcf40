"""Naive O(T^2) causal AFT-local, written straight from the formula: the oracle for both forms."""

import torch


def naive_aft(q, k, v, w, decay):
    """q, k, v: (B, T, H, D); w: (H, s) window biases; decay: (H,). Returns (B, T, H, D)."""
    B, T, H, D = k.shape
    s = w.shape[1]
    out = torch.empty(B, T, H, D, dtype=torch.float64)
    q, k, v, w, decay = (x.double() for x in (q, k, v, w, decay))
    for t in range(T):
        num = torch.zeros(B, H, D, dtype=torch.float64)
        den = torch.zeros(B, H, D, dtype=torch.float64)
        for tp in range(t + 1):
            d = t - tp
            bias = w[:, d] if d < s else -decay * (d - s + 1)
            weight = torch.exp(k[:, tp] + bias[None, :, None])
            num += weight * v[:, tp]
            den += weight
        out[:, t] = torch.sigmoid(q[:, t]) * num / den
    return out
