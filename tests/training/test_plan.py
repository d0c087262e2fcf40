"""The plan (aftgen/training/plan.py): what a run settles for every option left out."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import train_tiny
from safetensors.torch import load_file

from aftgen.checkpoint import WEIGHTS
from aftgen.record import TRAINING_INFO

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_recipe_run_equals_the_run_given_every_setting_it_settled(tmp_path, corpus, tiny_run):
    """The plan decides what a left-out option is; given explicitly, the same values train the same weights."""
    from aftgen.training.options import RECIPE_FIELDS

    planned = train_tiny(corpus, tmp_path / "planned", eval_interval=None, eval_windows=None)
    info = json.loads((planned / TRAINING_INFO).read_text())
    settled = {name: info["options"][name] for name in (*RECIPE_FIELDS, "eval_interval", "eval_windows", "dtype")}
    sizes = {name: info["settings"][name] for name in ("n_layer", "n_embd", "n_head", "window", "context_length")}
    explicit = train_tiny(corpus, tmp_path / "explicit", **settled, **sizes, batch_size=info["settings"]["batch_size"])
    one, two = load_file(planned / WEIGHTS), load_file(explicit / WEIGHTS)
    assert one.keys() == two.keys() and all(torch.equal(one[name], two[name]) for name in one)
    given = json.loads((explicit / TRAINING_INFO).read_text())
    assert given["settings"] == info["settings"] and given["recipe"]["preset"] == info["recipe"]["preset"]
