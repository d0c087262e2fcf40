"""An exponential moving average of the weights (Polyak averaging), checked and published instead of the
last step's weights.

On a small corpus the held-out loss of the raw weights jitters from batch to batch and climbs once the
model starts to memorise; the average of the recent steps sits lower and turns later.
"""

from __future__ import annotations

import copy

import torch

from aftgen.model import AFTLM


class WeightAverage:
    """average <- decay * average + (1 - decay) * weights, after every optimiser step."""

    def __init__(self, model: AFTLM, decay: float):
        self.decay = decay
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    def update(self, model: AFTLM, step: int) -> None:
        """Fold in the weights after `step` steps. The decay ramps up over the first steps (as timm's
        ModelEma warmup does), so the random or base weights of step 0 fade out instead of dominating."""
        decay = min(self.decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(list(self.model.parameters()), list(model.parameters()), 1 - decay)
