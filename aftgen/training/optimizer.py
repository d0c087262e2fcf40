"""The optimisers (AdamW, or Muon for the blocks' matrices beside AdamW for the rest) and the learning-rate
schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch

from aftgen.errors import AftgenError
from aftgen.model import AFTLM
from aftgen.training.options import TrainOptions

BETAS = (0.9, 0.99)


def make_optimizer(model: AFTLM, options: TrainOptions) -> torch.optim.Optimizer | MuonWithAdamW:
    """AdamW, weight decay on the matrices only (not biases, norms, position biases or decays); with
    optimizer "muon", Muon for the blocks' matrices and AdamW for the rest (the embedding too)."""
    decayed, others = model.decayed_parameters()
    if options.optimizer == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise AftgenError(f"--optimizer muon needs torch.optim.Muon (torch 2.9 or newer, not {torch.__version__})")
        embedding = model.embed.weight
        matrices = [p for p in decayed if p is not embedding]
        adamw = [{"params": [embedding], "weight_decay": options.weight_decay}, {"params": others, "weight_decay": 0.0}]
        return MuonWithAdamW(
            # Moonshot's scaling of each matrix's update to AdamW's size, so both share the lr and weight decay.
            torch.optim.Muon(
                matrices, lr=options.lr, weight_decay=options.weight_decay, adjust_lr_fn="match_rms_adamw"
            ),
            torch.optim.AdamW(adamw, lr=options.lr, betas=BETAS),
        )
    groups = [{"params": decayed, "weight_decay": options.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=options.lr, betas=BETAS)


class MuonWithAdamW:
    """Two optimisers stepped as one, over one list of param groups: what the loop, GradScaler and the
    training state file see of an optimiser (step, zero_grad, param_groups, state_dict)."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.parts = (muon, adamw)

    @property
    def param_groups(self) -> list[dict]:
        """The parts' groups, read afresh: loading a state dict replaces an optimiser's group dicts."""
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """One state dict, the second optimiser's parameters numbered after the first's."""
        state, groups, offset = {}, [], 0
        for part in self.parts:
            saved = part.state_dict()
            state |= {index + offset: slots for index, slots in saved["state"].items()}
            groups += [group | {"params": [i + offset for i in group["params"]]} for group in saved["param_groups"]]
            offset += sum(len(group["params"]) for group in saved["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict) -> None:
        groups, offset = list(saved["param_groups"]), 0
        for part in self.parts:
            mine, groups = groups[: len(part.param_groups)], groups[len(part.param_groups) :]
            count = sum(len(group["params"]) for group in mine)
            state = {i - offset: s for i, s in saved["state"].items() if offset <= i < offset + count}
            part.load_state_dict({"state": state, "param_groups": [g | {"params": [i - offset for i in g["params"]]}
                                                                   for g in mine]})  # fmt: skip
            offset += count


def learning_rate(options: TrainOptions, step: int, progress: float) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr as progress goes 0 -> 1."""
    if step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return options.lr * (options.min_lr_ratio + (1 - options.min_lr_ratio) * cosine)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
