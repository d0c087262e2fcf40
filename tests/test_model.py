"""aftgen.model: the parallel form and the recurrent one give the same logits, and a config survives config.json."""

from __future__ import annotations

import json

import pytest
import torch

from aftgen.errors import AftgenError
from aftgen.model import AFTLM, AFTConfig, clone_state, tokens_read


def tiny_model(mixer: str = "aft_local") -> AFTLM:
    torch.manual_seed(0)
    config = AFTConfig(vocab_size=40, n_layer=2, n_embd=16, n_head=2, window=4, context_length=32, mixer=mixer)
    model = AFTLM(config).eval()
    with torch.no_grad():  # biases and decays away from their start, so the recurrent form's use of them shows
        for block in model.blocks:
            block.mixer.perturb_()
    return model


@pytest.mark.parametrize("mixer", ["aft_local", "attention"])
def test_prefill_then_step_gives_forwards_logits_at_every_position(mixer):
    model = tiny_model(mixer)
    ids = torch.randint(0, 40, (2, 12))
    expected = model(ids)
    logits, state = model.prefill(ids[:, :5])
    assert torch.allclose(logits, expected[:, :5], atol=1e-5)
    for position in range(5, 12):
        logits, state = model.step(ids[:, position], state)
        assert torch.allclose(logits, expected[:, position], atol=1e-5), position


def test_prefill_continues_a_state_and_reads_the_last_position_alone():
    model = tiny_model()
    ids = torch.randint(0, 40, (1, 10))
    _, state = model.prefill(ids[:, :6])
    last, state = model.prefill(ids[:, 6:], state, last_only=True)
    assert last.shape == (1, 1, 40)
    assert torch.allclose(last[:, 0], model(ids)[:, -1], atol=1e-5)
    assert tokens_read(state) == 10


def test_a_cloned_state_steps_apart_from_its_original():
    model = tiny_model()
    _, state = model.prefill(torch.randint(0, 40, (1, 6)))
    kept = clone_state(state)
    model.step(torch.tensor([3]), state)
    assert tokens_read(state) == 7 and tokens_read(kept) == 6
    again = clone_state(kept)
    assert torch.equal(model.step(torch.tensor([3]), kept)[0], model.step(torch.tensor([3]), again)[0])


def test_a_config_round_trips_through_json_and_refuses_what_it_does_not_know():
    config = AFTConfig.from_preset("tiny", vocab_size=300, activation="relu2", dropout=0.1)
    assert AFTConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(AftgenError, match="unknown keys: colour"):
        AFTConfig.from_dict(config.to_dict() | {"colour": "red"})
    with pytest.raises(AftgenError, match="'n_layer' must be int"):
        AFTConfig.from_dict(config.to_dict() | {"n_layer": True})
