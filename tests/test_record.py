"""A run's record read back (training.json, metrics.jsonl) as an older aftgen or another hand wrote it: a field
missing takes its default, one of another type is one clear error, never a traceback."""

from __future__ import annotations

import json

import pytest

from aftgen.card import run_card
from aftgen.errors import AftgenError
from aftgen.model import AFTConfig
from aftgen.record import METRICS, TRAINING_INFO, read_run_files

CHECK = {"step": 2, "held_out_nats_per_char": 2.5}


def test_an_older_runs_record_without_its_fields_makes_a_card_of_defaults(tmp_path):
    (tmp_path / TRAINING_INFO).write_text("{}")
    (tmp_path / METRICS).write_text(json.dumps(CHECK) + "\n")
    card = run_card(tmp_path, AFTConfig(vocab_size=300))
    assert "# aftgen model" in card and "| steps / wall time | ? / 0 s |" in card and "2.5000 nats/char" in card


@pytest.mark.parametrize(
    "info",
    [
        {"elapsed": "an hour"},
        {"held_out": []},
        {"command": None},
        {"parameters": "12"},
        {"final_eval": {"nats_per_char": "1.2", "bits_per_char": 1.7}},
        {"base_model": {"model": "x"}},
        {"best": {"step": 1e30, "held_out_nats_per_char": 1.0}, "options": {"keep_best": True}},
        {"options": None},
        {"settings": []},
    ],
)
def test_a_run_description_of_another_hand_is_one_error(tmp_path, info):
    (tmp_path / TRAINING_INFO).write_text(json.dumps(info))
    with pytest.raises(AftgenError, match=f"{TRAINING_INFO}: the run's description is not one aftgen can read"):
        run_card(tmp_path, AFTConfig(vocab_size=300))


@pytest.mark.parametrize("row", [{"step": 2}, CHECK | {"step": -1}, CHECK | {"held_out_nats_per_char": None}])
def test_a_held_out_check_of_another_hand_is_one_error(tmp_path, row):
    (tmp_path / METRICS).write_text(json.dumps(CHECK) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(AftgenError, match=f"{METRICS}: line 2: a held-out check is not one aftgen can read"):
        read_run_files(tmp_path)
