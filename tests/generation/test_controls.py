"""A sampling control is one entry in CONTROLS (aftgen.generation.controls) and its field in SamplingOptions: with
them, it is an option of `aftgen sample` and `aftgen chat`, a field the server checks against its range, and a
setting the engine draws beside other rows, each row with its own value."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import torch
from conftest import DEVICE
from serving import post, running
from typer.testing import CliRunner

from aftgen.api import load
from aftgen.cli import app
from aftgen.cli import generate as generate_cli
from aftgen.device import resolve
from aftgen.generation.context import recent_tokens
from aftgen.generation.controls import (
    API_DEFAULTS,
    CONTROLS,
    GREEDY_BELOW,
    Control,
    SamplingOptions,
    apply_repeat_penalty,
)
from aftgen.generation.drawing import choose, filter_logits
from aftgen.options import Range
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
    reference = (Path(__file__).parents[2] / "docs" / "reference.md").read_text(encoding="utf-8")
    table = controls_table(ServeOptions())
    assert table in reference, "docs/reference.md's table of controls is not the declaration's:\n" + table


PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def kept(logits: torch.Tensor, **options) -> int:
    return int(torch.isfinite(filter_logits(logits, SamplingOptions(temperature=1.0, **options))).sum())


def penalised(logits: torch.Tensor, history: torch.Tensor, penalty: float, last_n: int = 64) -> torch.Tensor:
    """Every row of logits with the same repeat penalty over its own history's last n ids."""
    rows, vocab = logits.shape
    recent = recent_tokens(history, [last_n] * rows, vocab, logits.device)
    return apply_repeat_penalty(logits, torch.full((rows, 1), penalty), recent)


def test_each_control_is_a_typed_field_of_sampling_options_with_its_default():
    """SamplingOptions' fields for the controls are CONTROLS, name for name, with the same type and default,
    and the HTTP API's own defaults name controls (a new control needs both its entry and its field)."""
    fields = {f.name: f for f in dataclasses.fields(SamplingOptions)}
    controls = [name for name in fields if name not in ("max_new_tokens", "seed", "stop", "num_samples", "constraint")]
    assert controls == list(CONTROLS)
    hints = typing.get_type_hints(SamplingOptions)
    for name, control in CONTROLS.items():
        assert fields[name].default == control.default and hints[name] is control.type, name
        assert getattr(SamplingOptions(), name) == control.default
    assert set(API_DEFAULTS) <= set(CONTROLS)
    with pytest.raises(TypeError):
        SamplingOptions(top_q=0.5)


def test_top_k_keeps_exactly_k_even_with_ties():
    assert kept(torch.randn(1, 50), top_k=5) == 5
    assert kept(torch.zeros(1, 50), top_k=3) == 3


@pytest.mark.parametrize("top_p,expected", [(0.5, 1), (0.8, 2), (0.81, 3), (0.95, 3), (0.96, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    assert kept(PROBS.log(), top_p=top_p) == expected


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    assert kept(PROBS.log(), min_p=0.2) == 3  # 0.05 < 0.2 * 0.5
    assert kept(PROBS.log(), min_p=0.7) == 1


def test_temperature_sharpens_or_flattens():
    logits = PROBS.log()
    entropy = [
        -(p * p.log()).sum()
        for p in (filter_logits(logits, SamplingOptions(temperature=t)).softmax(-1) for t in (0.5, 1, 2))
    ]
    assert entropy[0] < entropy[1] < entropy[2]
    greedy = choose(logits, SamplingOptions(temperature=0), torch.zeros(1, 0, dtype=torch.long), torch.Generator())
    assert int(greedy) == 0


def test_top_p_keeps_the_likeliest_token_even_where_float32_rounds_top_p_to_zero():
    assert kept(PROBS.log(), top_p=5e-324) == 1
    assert kept(PROBS.log(), top_p=1e-300) == 1


def test_the_smallest_temperature_and_penalty_sample_from_finite_probabilities():
    """At GREEDY_BELOW with a penalty of 1e-4 the recent tokens' scores grow 10^8 times: still finite."""
    torch.manual_seed(0)
    logits, history = torch.randn(16, 50) * 1e6, torch.randint(0, 50, (16, 8))
    options = SamplingOptions(temperature=GREEDY_BELOW, repeat_penalty=1e-4)
    probs = filter_logits(penalised(logits, history, 1e-4), options).softmax(-1)
    assert torch.isfinite(probs).all()
    drawn = choose(logits, options, history, [torch.Generator().manual_seed(i) for i in range(16)])
    assert torch.equal(drawn, penalised(logits, history, 1e-4).argmax(-1))  # the gaps are that large


def test_repeat_penalty_lowers_recent_tokens_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    assert penalised(logits, torch.tensor([[0, 1, 0]]), 2.0).tolist() == [[1.0, -4.0, 1.0]]  # each token once
    # Through choose: a greedy pick moves off a token made recently.
    options = SamplingOptions(temperature=0, repeat_penalty=3.0, repeat_last_n=2)
    assert int(choose(torch.tensor([[2.0, 1.0]]), options, torch.tensor([[0]]), torch.Generator())) == 1
    assert int(choose(torch.tensor([[2.0, 1.0]]), options, torch.tensor([[0, 1, 1]]), torch.Generator())) == 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "2.5"], "--temperature"),  # the server's range too
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--top-k", "-1"], "--top-k"),
        (["--min-p", "1"], "--min-p"),
        (["--repeat-penalty", "0"], "--repeat-penalty"),
        (["--repeat-penalty", "1e-300"], "--repeat-penalty"),  # below 1e-4 a penalty only overflows
        (["--repeat-last-n", "-1"], "--repeat-last-n"),
        (["-n", "-2"], "--max-new-tokens"),
        (["--num-samples", "0"], "--num-samples"),
        (["--stop", ""], "--stop"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "no such file"),
        (["--load-state", "/nonexistent/s.safetensors"], "no such state file"),
        (["--num-samples", "2", "--save-state", "s.safetensors"], "--save-state"),
    ],
)
def test_invalid_values_fail_before_any_work(args, message):
    # The model does not exist either: the option error coming first shows nothing was loaded.
    result = runner.invoke(app, ["sample", "--model", "/nonexistent/model", *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr


def test_cli_samples_greedily_below_the_smallest_temperature_that_matters(tiny_run):
    def sample(*args: str) -> str:
        result = runner.invoke(app, ["sample", "--model", str(tiny_run), "--device", DEVICE, "-p", "KING:", *args])
        assert result.exit_code == 0, result.output
        return result.stdout

    for penalty in ("1", "1.1"):
        greedy = sample("-n", "12", "--temperature", "0", "--repeat-penalty", penalty)
        for temperature in ("1e-300", "1e-39"):
            assert sample("-n", "12", "--temperature", temperature, "--repeat-penalty", penalty) == greedy
