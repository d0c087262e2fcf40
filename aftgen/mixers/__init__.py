"""Token mixers: the one part of a block that differs between model kinds (see protocol.Mixer).

MIXERS, the registry, is the one list of them: `--mixer`, config.json's check, the server, the
benchmarks and the every-mixer tests read it. A new mixer is a module with a class following Mixer
and one line here.
"""

from __future__ import annotations

from typing import NamedTuple

from aftgen.mixers.aft import AFTMixer
from aftgen.mixers.attention import AttentionMixer
from aftgen.mixers.protocol import Mixer, MixerConfig, MixerState


class Kind(NamedTuple):
    """A mixer by name: its class, and what it is in one line (`aftgen train --help`)."""

    mixer: type[Mixer]
    about: str


MIXERS: dict[str, Kind] = {
    "aft_local": Kind(AFTMixer, "AFT, relative biases inside --window and a learned decay beyond"),
    "aft_simple": Kind(AFTMixer, "no window"),
    "aft_full": Kind(AFTMixer, "window = whole context; generation O(context) per token"),
    "attention": Kind(AttentionMixer, "softmax + KV cache, the baseline"),
}

__all__ = [
    "MIXERS",
    "AFTMixer",
    "AttentionMixer",
    "Kind",
    "Mixer",
    "MixerState",
    "fixed_size_state",
    "make_mixer",
    "shaping_fields",
]


def fixed_size_state(mixer: str) -> bool:
    """Whether mixer `mixer`'s state keeps one size however long the stream (Mixer.fixed_size_state)."""
    return MIXERS[mixer].mixer.fixed_size_state


def shaping_fields(config: MixerConfig) -> tuple[str, ...]:
    """Config fields that set the shapes of config.mixer's weights besides the widths (Mixer.shaping_fields)."""
    return MIXERS[config.mixer].mixer.shaping_fields(config)


def make_mixer(config: MixerConfig) -> Mixer:
    """The token mixer config.mixer names."""
    return MIXERS[config.mixer].mixer.from_config(config)
