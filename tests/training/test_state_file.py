"""The training state file (aftgen/training/state_file.py): what a resumed run reads back is what was saved,
and a header that does not describe a run is one error that says how to start again."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from aftgen.checkpoint import safetensors_metadata
from aftgen.errors import AftgenError
from aftgen.model import AFTLM, AFTConfig
from aftgen.record import TRAINING_STATE
from aftgen.training.options import MODEL_FIELDS
from aftgen.training.state_file import load_training_state, read_training_info, save_training_state

CONFIG = AFTConfig(vocab_size=50, n_layer=1, n_embd=16, n_head=2, window=4, context_length=16)
INFO = {"settings": dict.fromkeys(MODEL_FIELDS, 0) | {"batch_size": 4}, "step": 3, "elapsed": 1.5}


def trained(seed: int) -> tuple[AFTLM, torch.optim.Optimizer]:
    """A tiny model and its AdamW after two steps, so that the optimiser holds moments."""
    torch.manual_seed(seed)
    model = AFTLM(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    for _ in range(2):
        model(torch.randint(0, 50, (2, 16))).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_a_saved_state_loads_back_weights_moments_and_random_states(tmp_path):
    model, optimizer = trained(seed=0)
    generator = torch.Generator().manual_seed(7)
    torch.rand(3, generator=generator)  # both generators moved on from their seeds
    torch.rand(3)
    save_training_state(tmp_path, model, optimizer, generator, INFO)
    expected_draws = torch.rand(4), torch.rand(4, generator=generator)

    fresh, fresh_optimizer = trained(seed=1)
    fresh_generator = torch.Generator().manual_seed(99)
    average = AFTLM(CONFIG)  # the file holds no average: it starts from the restored weights
    assert load_training_state(tmp_path, fresh, fresh_optimizer, fresh_generator, average) == INFO
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
        assert torch.equal(average.state_dict()[name], tensor), name
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]  # betas come back as a tuple, as AdamW holds them
    for index, slots in saved["state"].items():
        for key, value in slots.items():
            assert torch.equal(torch.as_tensor(loaded["state"][index][key]), torch.as_tensor(value)), (index, key)
    draws = torch.rand(4), torch.rand(4, generator=fresh_generator)
    assert all(torch.equal(a, b) for a, b in zip(draws, expected_draws, strict=True))


def describing(folder, info: object) -> None:
    """Rewrite the state file's header to describe the run as `info`."""
    path = folder / TRAINING_STATE
    metadata = safetensors_metadata(path) | {"info": json.dumps(info)}
    save_file(load_file(path), path, metadata=metadata)


@pytest.mark.parametrize(
    "info, problem",
    [
        ({k: v for k, v in INFO.items() if k != "settings"}, "its settings lack some of n_layer"),
        (INFO | {"settings": INFO["settings"] | {"batch_size": 0}}, "batch_size 0 is not a whole number above 0"),
        (INFO | {"step": -1}, "it lacks the step or the time trained"),
        (INFO | {"elapsed": float("nan")}, "it lacks the step or the time trained"),
        (INFO | {"best": {"step": 2}}, "its best held-out check lacks a step or a score"),
        (INFO | {"recipe": [1]}, "its recipe is not a JSON object"),
        ([INFO], "its description is not a JSON object"),
    ],
    ids=[
        "no settings",
        "batch size 0",
        "negative step",
        "time not a number",
        "best without score",
        "recipe list",
        "a list",
    ],
)
def test_a_header_that_does_not_describe_a_run_is_one_error_saying_start_again(tmp_path, info, problem):
    model, optimizer = trained(seed=0)
    save_training_state(tmp_path, model, optimizer, torch.Generator(), INFO)
    assert read_training_info(tmp_path)[0] == INFO
    describing(tmp_path, info)
    with pytest.raises(AftgenError, match=rf"cannot read training state \({problem}.*\); start again with --overwrite"):
        read_training_info(tmp_path)
