"""What every token mixer provides: a parallel form, a step form, a recurrent state, and what the rest of
aftgen needs to know about it (which parameters skip weight decay, whether its state keeps one size, ...)."""

from __future__ import annotations

from typing import Protocol

import torch

# Per layer; tensors batch-first, "position" among them: (B,), each row's count of tokens read. A state that
# grows (fixed_size_state False: never batched) may keep a 0-dim one.
MixerState = dict[str, torch.Tensor]


class MixerConfig(Protocol):
    """What a mixer reads of the model's config (aftgen.model.AFTConfig), so mixers never import the model."""

    mixer: str  # the mixer's name in the registry (aftgen.mixers.MIXERS)
    n_embd: int
    n_head: int
    window: int
    context_length: int
    decay: bool


class Mixer(Protocol):
    """A causal token mixer: x (B, T, C) -> (B, T, C), reading only earlier tokens."""

    # Names of parameters AdamW must not decay (position biases, decays): matrices are decayed, the rest not.
    no_weight_decay: tuple[str, ...]
    # Whether the state keeps one size however long the stream: the server can then batch states of
    # different lengths (stacked row by row, every tensor batch-first), and a stream can be read past the
    # training length.
    fixed_size_state: bool

    @classmethod
    def from_config(cls, config: MixerConfig) -> Mixer:
        """The mixer config.mixer names, sized by the config."""
        ...

    @classmethod
    def shaping_fields(cls, config: MixerConfig) -> tuple[str, ...]:
        """Config fields besides the widths (n_embd, n_head) that set its weights' shapes: fine-tuning keeps them."""
        ...

    def forward(
        self, x: torch.Tensor, state: MixerState | None = None, return_state: bool = False, last_only: bool = False
    ) -> tuple[torch.Tensor, MixerState | None]:
        """The parallel form: all of x at once, continuing `state` (None: from nothing).

        `return_state` returns the state after the last token; `last_only` the output of that token alone (B, 1, C).
        """
        ...

    def step(self, x: torch.Tensor, state: MixerState) -> torch.Tensor:
        """The step form: one token per sequence, x (B, C) -> (B, C), updating `state` in place."""
        ...

    def initial_state(self, batch_size: int, device: torch.device | None = None) -> MixerState:
        """The state before any token."""
        ...

    def perturb_(self) -> None:
        """Draw the parameters that start at special values (zero biases, slow decays) at random, in place,
        from torch's generator, so that tests comparing the forms exercise every term."""
        ...
