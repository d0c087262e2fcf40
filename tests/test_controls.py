"""A sampling control is one entry in aftgen.sampling.CONTROLS and its field in SamplingOptions: with them, it is
an option of `aftgen sample` and `aftgen chat`, a field the server checks against its range, and a setting the
engine draws beside other rows, each row with its own value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import DEVICE
from test_serve import post, running
from typer.testing import CliRunner

from aftgen.api import load
from aftgen.cli import app
from aftgen.cli import generate as generate_cli
from aftgen.device import resolve
from aftgen.sampling import CONTROLS, Control, Range, SamplingOptions
from aftgen.serve import schema
from aftgen.serve.engine import Engine
from aftgen.serve.options import ServeOptions
from aftgen.serve.schema import controls_table
from aftgen.serve.work import Done, Work

runner = CliRunner()


@dataclasses.dataclass
class SpreadOptions(SamplingOptions):
    spread: float = 1.0


@pytest.fixture
def spread(monkeypatch) -> list[tuple[float, ...]]:
    """A test-only control `spread` in [0.5, 4], added as a real one is (its entry in CONTROLS, its field in
    SamplingOptions, here a subclass put where options are made): its filter divides the logits by each row's
    value and records the values (one per row) of every call. Removed again after the test."""
    seen: list[tuple[float, ...]] = []

    def divide(logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(values.flatten().tolist()))
        return logits / values

    monkeypatch.setitem(CONTROLS, "spread", Control(1.0, Range(0.5, 4), "Test only: flatten the odds.", divide))
    monkeypatch.setattr(generate_cli, "Defaults", SpreadOptions)
    monkeypatch.setattr(schema, "SamplingOptions", SpreadOptions)
    return seen


@pytest.mark.parametrize("command", ["sample", "chat"])
def test_a_new_control_is_an_option_with_its_range(spread, command):
    assert "--spread" in runner.invoke(app, [command, "--help"]).output
    result = runner.invoke(app, [command, "--model", "/nonexistent/model", "--spread", "9"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: --spread must be in [0.5, 4], got 9.0"


def test_sample_hands_a_new_control_to_its_filter(spread, tiny_run):
    args = ["sample", "--model", str(tiny_run), "--device", DEVICE, "-p", "KING:", "-n", "3", "--spread", "2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert spread and set(spread) == {(2.0,)}


def test_the_server_takes_a_new_control_within_its_range(spread, tiny_run):
    with running(tiny_run, in_process=True) as url:  # the control is added in this process only
        taken = post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 2, "spread": 2})
        assert taken.status_code == 200, taken.text
        assert (2.0,) in spread
        refused = post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 2, "spread": 9})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "spread"
        assert "[0.5, 4]" in refused.json()["error"]["message"]


def test_rows_that_differ_in_a_new_control_are_drawn_together_each_with_its_own_value(spread, tiny_run):
    """Two requests stepped in one batch: one call of the filter a token, with each row's own value."""
    model, tokenizer = load(tiny_run, device=DEVICE)
    engine = Engine(model, tokenizer, ServeOptions(cache_mb=0), resolve(DEVICE, "fp32"))
    events: list = []
    engine.publish = events.extend

    def run(*values: float) -> list[tuple[float, ...]]:
        spread.clear()
        for value in values:
            options = SpreadOptions(max_new_tokens=3, temperature=1.0, seed=1, spread=value)
            engine.submit(Work(tokenizer.encode("KING:"), options))
        while sum(isinstance(event, Done) for _, event in events) < len(values):
            engine.turn()
        events.clear()
        return spread

    assert set(run(2.0, 2.0)) == {(2.0, 2.0)}
    assert set(run(0.5, 2.0)) == {(0.5, 2.0)}


def test_the_reference_shows_the_controls_as_declared():
    """docs/reference.md's table of controls is made from CONTROLS, API_DEFAULTS and the schema, not retyped."""
    reference = (Path(__file__).parent.parent / "docs" / "reference.md").read_text(encoding="utf-8")
    table = controls_table(ServeOptions())
    assert table in reference, "docs/reference.md's table of controls is not the declaration's:\n" + table
