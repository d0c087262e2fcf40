"""Token mixers: the one part of a block that differs between model kinds (see protocol.Mixer).

- aft_local: AFT with a window of config.window tokens (aft.py), the default;
- aft_simple: AFT with no window, only the learned decay;
- aft_full: AFT whose window is the whole training context (its step costs O(context) per token);
- attention: softmax attention with RoPE and a KV cache (attention.py), the baseline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aftgen.mixers.aft import AFTMixer
from aftgen.mixers.attention import AttentionMixer
from aftgen.mixers.protocol import Mixer, MixerState

if TYPE_CHECKING:
    from aftgen.model import AFTConfig

KINDS: dict[str, type] = {
    "aft_local": AFTMixer,
    "aft_simple": AFTMixer,
    "aft_full": AFTMixer,
    "attention": AttentionMixer,
}
MIXERS = tuple(KINDS)

__all__ = ["MIXERS", "AFTMixer", "AttentionMixer", "Mixer", "MixerState", "fixed_size_state", "make_mixer"]


def fixed_size_state(mixer: str) -> bool:
    """Whether mixer `mixer`'s state keeps one size however long the stream (Mixer.fixed_size_state)."""
    return KINDS[mixer].fixed_size_state


def make_mixer(config: AFTConfig) -> Mixer:
    """The token mixer config.mixer names."""
    if config.mixer == "attention":
        return AttentionMixer(config.n_embd, config.n_head)
    window = {"aft_local": config.window, "aft_simple": 0, "aft_full": config.context_length}[config.mixer]
    return AFTMixer(config.n_embd, config.n_head, window, config.context_length, config.decay)
