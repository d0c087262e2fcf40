"""AdamW and its learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch

from aftgen.model import AFTLM
from aftgen.training.options import TrainOptions


def make_optimizer(model: AFTLM, options: TrainOptions) -> torch.optim.AdamW:
    """AdamW; weight decay on the matrices only (not biases, norms, position biases or decays)."""
    decayed, others = model.decayed_parameters()
    groups = [{"params": decayed, "weight_decay": options.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=options.lr, betas=(0.9, 0.99))


def learning_rate(options: TrainOptions, step: int, progress: float) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr as progress goes 0 -> 1."""
    if step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return options.lr * (options.min_lr_ratio + (1 - options.min_lr_ratio) * cosine)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
