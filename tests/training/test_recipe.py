"""The recipe: what a fresh run trains when the user does not say (aftgen/training/recipe.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import train_tiny

from aftgen.device import resolve
from aftgen.model import AFTConfig
from aftgen.record import TRAINING_INFO
from aftgen.training import probe, recipe
from aftgen.training.options import TrainOptions
from aftgen.training.recipe import choose

# Tokens/s measured on a 2-core CPU (bf16) and guessed for a GPU: the speeds choose() is given.
CPU = {"small": 20_000, "medium": 9_000, "large": 2_000}
GPU = {"small": 400_000, "medium": 250_000, "large": 150_000}
SHAKESPEARE = 395_000  # training tokens of Tiny Shakespeare with a 1024-piece vocabulary
BOOKS = 2_000_000  # enough for medium (7.9M parameters)


def speeds(table: dict[str, float], asked: list[str] | None = None):
    def speed(preset: str) -> float:
        if asked is not None:
            asked.append(preset)
        return table[preset]

    return speed


def test_a_short_budget_trains_the_small_model_regularised_less_than_a_long_one():
    short = choose(SHAKESPEARE, 1024, max_time=120, max_steps=None, speed=speeds(CPU))
    long = choose(SHAKESPEARE, 1024, max_time=1800, max_steps=None, speed=speeds(CPU), presets=("small",))
    assert short.preset == "small" and short.passes < long.passes
    assert short.dropout < long.dropout and short.weight_decay <= long.weight_decay
    assert short.keep_best and short.patience > 0


def test_the_default_budget_on_shakespeare_trains_the_small_model_heavily_regularised():
    chosen = choose(SHAKESPEARE, 1024, max_time=None, max_steps=None, speed=speeds(CPU))
    assert chosen.max_time == recipe.DEFAULT_BUDGET
    assert chosen.preset == "small"  # 395k tokens are too few for medium's 7.9M parameters
    assert chosen.passes == pytest.approx(recipe.DEFAULT_BUDGET * CPU["small"] / SHAKESPEARE, rel=0.01)
    assert chosen.dropout >= 0.3 and chosen.weight_decay >= 0.3 and chosen.ema > 0
    assert chosen.steps >= recipe.MIN_STEPS and chosen.optimizer == "adamw"


def test_a_run_that_reads_its_text_a_few_times_gets_no_dropout_or_average():
    chosen = choose(SHAKESPEARE, 1024, max_time=120, max_steps=None, speed=speeds(CPU))
    assert chosen.passes < 8 and chosen.dropout == 0.0 and chosen.ema == 0.0 and chosen.keep_best


def test_weight_decay_is_heavy_only_for_a_text_read_many_times():
    twice = choose(SHAKESPEARE, 1024, max_time=None, max_steps=400, speed=speeds({}), presets=("small",))
    often = choose(SHAKESPEARE, 1024, max_time=None, max_steps=1400, speed=speeds({}), presets=("small",))
    assert twice.passes < 4 < often.passes
    assert twice.weight_decay == 0.1 and often.weight_decay == 1.0


def test_a_larger_corpus_and_budget_train_a_larger_model():
    assert choose(BOOKS, 1024, max_time=7200, max_steps=None, speed=speeds(CPU)).preset == "medium"
    assert choose(BOOKS, 1024, max_time=900, max_steps=None, speed=speeds(CPU)).preset == "small"  # too few steps


def test_a_tiny_corpus_over_a_long_budget_gets_heavy_regularisation():
    small_text = choose(50_000, 1024, max_time=1800, max_steps=None, speed=speeds(CPU))
    large_text = choose(5_000_000, 1024, max_time=1800, max_steps=None, speed=speeds(CPU))
    assert small_text.passes > large_text.passes
    assert small_text.dropout > large_text.dropout
    assert small_text.weight_decay >= large_text.weight_decay


def test_a_large_corpus_on_a_fast_machine_trains_the_large_model_without_dropout():
    chosen = choose(1_000_000_000, 1024, max_time=3600, max_steps=None, speed=speeds(GPU))
    assert chosen.preset == "large"
    assert chosen.dropout == 0.0 and chosen.passes < 2


def test_a_size_too_slow_even_at_the_smaller_ones_speed_is_not_measured():
    asked: list[str] = []
    assert choose(BOOKS, 1024, max_time=120, max_steps=None, speed=speeds(CPU, asked)).preset == "small"
    assert asked == ["small"]  # medium could not make enough steps even at small's speed
    asked.clear()
    assert choose(BOOKS, 1024, max_time=1200, max_steps=None, speed=speeds(CPU, asked)).preset == "small"
    assert asked == ["small", "medium"]  # medium measured and found too slow; large never built


def test_a_budget_in_steps_chooses_a_size_the_default_budget_affords():
    chosen = choose(BOOKS, 1024, max_time=None, max_steps=6000, speed=speeds(GPU))
    assert chosen.preset == "medium" and chosen.max_time is None and chosen.steps == 6000
    assert chosen.passes == pytest.approx(6000 * recipe.tokens_per_step("medium") / BOOKS, rel=0.01)
    # On a CPU medium would make too few of those steps in the default budget.
    assert choose(BOOKS, 1024, max_time=None, max_steps=6000, speed=speeds(CPU)).preset == "small"


def test_one_size_and_a_budget_in_steps_need_no_measurement():
    chosen = choose(SHAKESPEARE, 1024, max_time=None, max_steps=3000, speed=speeds({}), presets=("small",))
    assert chosen.tokens_per_s is None and chosen.steps == 3000


def test_passes_count_the_steps_the_user_sized():
    quarter = recipe.tokens_per_step("small") // 4  # e.g. --context-length 32 on the small preset
    chosen = choose(SHAKESPEARE, 1024, None, 3000, speeds({}), presets=("small",), step_tokens=lambda _: quarter)
    assert chosen.passes == pytest.approx(3000 * quarter / SHAKESPEARE, rel=0.01)


@pytest.mark.parametrize("named", ["small", "large"])
def test_a_named_preset_is_kept_where_the_recipe_would_choose_another(named):
    """--preset passes one preset: the recipe keeps it, smaller or far slower than what it would choose."""
    free = choose(BOOKS, 1024, max_time=7200, max_steps=None, speed=speeds(CPU))
    assert free.preset == "medium"  # the premise: left alone, the recipe chooses neither
    kept = choose(BOOKS, 1024, max_time=7200, max_steps=None, speed=speeds(CPU), presets=(named,))
    assert kept.preset == named


def test_checks_are_spread_over_the_budget():
    """Patience counts checks, so the checks' spacing must follow the budget, not a coarse rounding of it: plans
    of 3,609 and 3,867 steps (the same budget, two probes' noise) both get about 25 checks."""
    for max_steps in (40, 900, 3_609, 3_867, 12_345):
        chosen = choose(SHAKESPEARE, 1024, max_time=None, max_steps=max_steps, speed=speeds(CPU))
        checks = max_steps / chosen.eval_interval
        assert checks == (20 if max_steps == 40 else pytest.approx(recipe.CHECKS_PER_RUN, rel=0.05))
        assert 1 <= chosen.warmup_steps <= max_steps // 10


def test_the_regularisation_table_grows_with_passes():
    rows = recipe.REGULARISATION
    assert [row.passes for row in rows] == sorted(row.passes for row in rows)
    assert [row.dropout for row in rows] == sorted(row.dropout for row in rows)


def test_training_json_records_the_recipe_and_explicit_options_win(tmp_path, corpus, one_thread):
    out = train_tiny(corpus, tmp_path / "run", max_steps=6, eval_interval=None, ema=0.0, dropout=0.05)
    info = json.loads((out / TRAINING_INFO).read_text())
    chosen, options = info["recipe"], info["options"]
    assert chosen["preset"] == "tiny" and chosen["steps"] == 6  # --preset tiny and --max-steps 6, kept
    assert options["ema"] == 0.0 and options["dropout"] == 0.05  # given: they win over the recipe
    assert options["eval_interval"] == chosen["eval_interval"] and options["patience"] == chosen["patience"]
    assert info["settings"]["dropout"] == 0.05


def test_the_recipe_builds_relu2_and_an_explicit_activation_wins(tmp_path, corpus, one_thread):
    chosen = train_tiny(corpus, tmp_path / "recipe", max_steps=2, eval_interval=None)
    assert json.loads((chosen / "config.json").read_text())["activation"] == recipe.ACTIVATION == "relu2"
    given = train_tiny(corpus, tmp_path / "old", max_steps=2, eval_interval=None, activation=recipe.FIXED["activation"])
    assert json.loads((given / "config.json").read_text())["activation"] == "gelu"  # as before the recipe
    info = json.loads((given / TRAINING_INFO).read_text())
    assert info["recipe"]["activation"] == "relu2" and info["options"]["activation"] == "gelu"


def test_resume_goes_on_with_the_recipe_it_started_with(tmp_path, corpus, one_thread, monkeypatch):
    out = train_tiny(corpus, tmp_path / "run", max_steps=4, eval_interval=None, dtype="auto")
    first = json.loads((out / TRAINING_INFO).read_text())

    def refuse(*_, **__):
        raise AssertionError("a resumed run must not choose a new recipe")

    monkeypatch.setattr(recipe, "choose", refuse)
    train_tiny(corpus, out, resume=True, max_steps=8, eval_interval=None, dtype="auto")
    resumed = json.loads((out / TRAINING_INFO).read_text())
    assert resumed["step"] == 8
    assert resumed["recipe"] == first["recipe"]
    for name in ("lr", "eval_interval", "patience", "keep_best", "dropout", "dtype"):
        assert resumed["options"][name] == first["options"][name], name


def shipped_model_options() -> dict[str, str]:
    """recipes/shakespeare.args, what `make default-model` gives `aftgen train`: {"--max-time": "15m", ...}."""
    lines = (Path(__file__).parents[2] / "recipes" / "shakespeare.args").read_text().splitlines()
    return dict(line.split(" ", 1) for line in lines if line and not line.startswith("#"))


def test_the_shipped_model_is_the_recipes_but_for_what_its_recipe_file_names():
    """make default-model names its budget and precisions (recipes/shakespeare.args); the rest is what the
    recipe chooses for Tiny Shakespeare, as the file and the model's card say."""
    options = shipped_model_options()
    assert set(options) == {"--max-time", "--dtype", "--weights-dtype"}
    budget = TrainOptions(corpus=Path("tinyshakespeare.txt"), max_time=options["--max-time"]).max_time
    chosen = choose(SHAKESPEARE, 1024, max_time=budget, max_steps=None, speed=speeds(CPU))
    assert (chosen.preset, chosen.activation, chosen.optimizer) == ("small", "relu2", "adamw")
    assert (chosen.dropout, chosen.weight_decay, chosen.ema, chosen.lr) == (0.3, 1.0, 0.995, 2e-3)
    assert (chosen.eval_interval, chosen.eval_windows, chosen.keep_best, chosen.patience) == (350, 100, True, 3)


def test_the_plan_is_made_at_the_speed_of_the_step_with_the_dropout_the_recipe_chose(monkeypatch):
    """The sizes are timed before a dropout is chosen, and dropout slows a step: the chosen size is timed again
    with it, and the steps the run plans (its recipe line's `at N tok/s`) come from that speed."""
    timed = []

    def tokens_per_s(config, batch_size, placement):
        timed.append((config.n_embd, config.dropout))
        return 20_000.0 * (0.8 if config.dropout else 1.0)

    monkeypatch.setattr(probe, "tokens_per_s", tokens_per_s)
    monkeypatch.setattr(probe, "check_seconds", lambda config, windows, device: 0.0)
    options = TrainOptions(corpus=Path("corpus.txt"), dtype="fp32", max_time=900.0)
    chosen = probe.choose_recipe(options, SHAKESPEARE, ("small",), sized, resolve("cpu", "fp32"))
    assert chosen.dropout > 0 and timed == [(192, 0.0), (192, chosen.dropout)]
    assert chosen.tokens_per_s == 16_000.0
    assert chosen.steps == int(900 * 16_000 / (16 * 128))
    given = replace(options, dropout=0.0)  # the user's own dropout is the one timed, from the start
    timed.clear()
    assert probe.choose_recipe(given, SHAKESPEARE, ("small",), sized, resolve("cpu", "fp32")).tokens_per_s == 20_000.0
    assert timed == [(192, 0.0)]


def test_the_plan_leaves_the_held_out_checks_their_share_of_the_time(monkeypatch):
    """A check's scores (two with a weight average) are timed with the windows the run scores, and the plan's
    speed is the run's over its whole budget: its steps fit beside its checks."""
    scored = []

    def check_seconds(config, windows, device) -> float:
        scored.append(windows)
        return 0.5

    monkeypatch.setattr(probe, "tokens_per_s", lambda config, batch_size, placement: 20_000.0)
    monkeypatch.setattr(probe, "check_seconds", check_seconds)
    options = TrainOptions(corpus=Path("corpus.txt"), dtype="fp32", max_time=900.0, dropout=0.0)
    first = recipe.choose(SHAKESPEARE, 1024, 900.0, None, lambda preset: 20_000.0, ("small",), "fp32", lambda p: 2048)
    chosen = probe.choose_recipe(options, SHAKESPEARE, ("small",), sized, resolve("cpu", "fp32"))
    assert scored == [first.eval_windows] and first.ema
    assert (chosen.dropout, chosen.weight_decay, chosen.ema) == (first.dropout, first.weight_decay, first.ema)
    checks_time = recipe.CHECKS_PER_RUN * 2 * 0.5  # a long budget makes them all
    assert chosen.tokens_per_s == pytest.approx(20_000.0 * (1 - checks_time / 900))
    assert chosen.steps * 2048 / 20_000.0 + chosen.steps / first.eval_interval * 2 * 0.5 <= 900


def sized(preset: str) -> tuple[AFTConfig, int]:
    """A preset's model without dropout, at batch 16 (what plan.py hands the probe for a fresh run)."""
    return AFTConfig.from_preset(preset, 1024), 16
