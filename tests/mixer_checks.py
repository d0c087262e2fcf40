"""What every token mixer must do, as checks a test runs on a mixer's name: the mixers in MIXERS
(tests/test_mixers.py) and those registered at run time (tests/test_mixer_registry.py)."""

from __future__ import annotations

import torch
from conftest import on_device

from aftgen.model import AFTLM, AFTConfig


def tiny_model(mixer: str, seed: int = 0) -> AFTLM:
    torch.manual_seed(seed)
    config = AFTConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=4, window=8, context_length=64, mixer=mixer)
    model = on_device(AFTLM(config).eval())
    for block in model.blocks:
        block.mixer.perturb_()  # non-trivial biases and decays, so the tests exercise them
    return model


def token_ids(shape, seed):
    return on_device(torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(seed)))


def check_prefill_then_step_equals_parallel(mixer: str) -> None:
    model = tiny_model(mixer)
    ids = token_ids((2, 150), 2)  # past the training length (64), so RoPE and the decay run beyond it
    with torch.inference_mode():
        full = model(ids)
        first, state = model.prefill(ids[:, :70])
        second, state = model.prefill(ids[:, 70:97], state)
        stepped = torch.stack([model.step(ids[:, t], state)[0] for t in range(97, 150)], dim=1)
    assert (first - full[:, :70]).abs().max() <= 1e-4
    assert (second - full[:, 70:97]).abs().max() <= 1e-4
    assert (stepped - full[:, 97:]).abs().max() <= 1e-4


def check_prefill_last_only_gives_the_last_logits_and_the_same_state(mixer: str) -> None:
    # The last block computes its output for the last token alone (from the state, for AFT), so
    # check it from an empty state and continuing one, over chunks longer and shorter than the window.
    model = tiny_model(mixer)
    ids = token_ids((2, 115), 3)
    every_state, last_state = None, None
    with torch.inference_mode():
        for lo, hi in ((0, 40), (40, 45), (45, 115)):
            every, every_state = model.prefill(ids[:, lo:hi], every_state)
            last, last_state = model.prefill(ids[:, lo:hi], last_state, last_only=True)
            assert last.shape == (2, 1, 50)
            assert (last - every[:, -1:]).abs().max() <= 1e-4
            for layer, same in zip(every_state, last_state, strict=True):
                assert all(torch.equal(layer[name], same[name]) for name in layer)


def check_causality(mixer: str) -> None:
    model = tiny_model(mixer)
    ids = token_ids((1, 120), 3)
    changed = ids.clone()
    changed[0, 70] = (changed[0, 70] + 1) % 50
    with torch.inference_mode():
        a, b = model(ids), model(changed)
    assert (a[:, :70] - b[:, :70]).abs().max() <= 1e-5
    assert (a[:, 70:] - b[:, 70:]).abs().max() > 1e-3  # and the change is seen from there on
