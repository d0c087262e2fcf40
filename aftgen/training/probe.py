"""How fast this machine trains a model of given sizes: a few real optimiser steps on random tokens,
timed (the recipe's measure of the machine)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from aftgen import cores, evaluate
from aftgen.device import DTYPES, Placement, synchronize
from aftgen.model import AFTLM, AFTConfig
from aftgen.training import recipe
from aftgen.training.options import RECIPE_FIELDS, TrainOptions

WARM_UP_STEPS, TIMED_STEPS = 2, 3

# Of a time budget, the most the recipe's own held-out checks may take: a short budget gets fewer than
# CHECKS_PER_RUN. A 40-s run of preset small on 2 cores spent an eighth of its time on 25 checks and their saves
# (docs/recipe.md), and a plan from a slow probe (a busy moment) checked every step; at a tenth, a 15-minute run
# still makes all 25 (1-3% of it here) and a 40-s one 6-8, enough for the best check and patience to matter.
CHECKS_SHARE = 0.1
MOST_ON_CHECKS = 0.5  # of the budget, with the user's --eval-interval: beyond it the plan is wrong about something


def training_step(model: AFTLM, batch: int, length: int, autocast: Callable) -> Callable[[], None]:
    """One AdamW step on a fixed batch of random tokens, to time: the forward pass under `autocast`, the
    backward outside it, as training runs them (a backward under autocast recasts the gradients of the
    mixer's fp32 sums to bf16 on a GPU, and fails there)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, length + 1), device=model.embed.weight.device)

    def step() -> None:
        with autocast():
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def tokens_per_s(config: AFTConfig, batch_size: int, placement: Placement, steps: int = TIMED_STEPS) -> float:
    """Training tokens/s of a model of `config` at `batch_size` (AdamW, autocast as placed), measured
    after WARM_UP_STEPS steps; the model is thrown away afterwards, and torch's random state is kept."""
    with torch.random.fork_rng(devices=[placement.device] if placement.device.type == "cuda" else []):
        model = AFTLM(config).to(placement.device).train()
        step = training_step(model, batch_size, config.context_length, placement.autocast)
        for _ in range(WARM_UP_STEPS):
            step()
        synchronize(placement.device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(placement.device)
        return steps * batch_size * config.context_length / (time.perf_counter() - start)


def choose_recipe(
    options: TrainOptions,
    train_tokens: int,
    presets: tuple[str, ...],
    sized: Callable[[str], tuple[AFTConfig, int]],
    placement: Placement,
) -> recipe.Recipe:
    """The recipe for a fresh run (recipe.choose) among `presets`, measuring this machine's speed as it goes (a
    few seconds, before the budget's clock starts); with a time budget, planned at the speed the run will make
    over it (`run_speed`). `sized(preset)`: the model and batch size the run would train.

    Measured at the share of the cores the run will have (aftgen.cores): taken afresh first (a run started
    beside this one registered as it started, while this one prepared its corpus), and measured again if it
    changed meanwhile (a run that came or went): a probe that one of two runs started together took on every
    core, the other's beside it, planned both too slow."""
    threads = cores.look()
    chosen = _measured(options, train_tokens, presets, sized, placement)
    if cores.look() != threads:
        chosen = _measured(options, train_tokens, presets, sized, placement)
    return chosen


def _measured(options, train_tokens, presets, sized, placement) -> recipe.Recipe:
    """choose_recipe's recipe, from one measurement of the machine."""
    dtype = _dtype(options.dtype, sized(presets[0]), placement)
    chosen = Placement(placement.device, DTYPES[dtype])

    def speed(preset: str) -> float:
        return tokens_per_s(*sized(preset), chosen)

    def step_tokens(preset: str) -> int:
        config, batch_size = sized(preset)
        return batch_size * config.context_length

    vocab_size = sized(presets[0])[0].vocab_size
    budget = (train_tokens, vocab_size, options.max_time, options.max_steps)
    first = recipe.choose(*budget, speed, presets, dtype, step_tokens)
    if first.max_time is None:  # a budget in steps: no plan by speed
        return first
    rate, checks = run_speed(first, options, sized(first.preset), chosen)
    planned = recipe.choose(*budget, lambda preset: rate, (first.preset,), dtype, step_tokens, checks)
    # The regularisation stays the one chosen at the step's own speed, the one `rate` was measured with: the
    # checks' share of the time changes how many steps fit, not what the text needs.
    return replace(planned, dropout=first.dropout, weight_decay=first.weight_decay, ema=first.ema)


def run_speed(
    planned: recipe.Recipe, options: TrainOptions, model: tuple[AFTConfig, int], placement: Placement
) -> tuple[float, int]:
    """Training tokens/s over the whole of `planned`'s time budget, and the held-out checks it makes. Its step
    is timed again with the dropout it will train with (the sizes were timed before the recipe chose one, and
    dropout 0.3 costs a small model about a tenth of its step on a CPU), and its checks take their share of the
    budget (two scores a check with a weight average): CHECKS_PER_RUN of them, fewer where they would take more
    than CHECKS_SHARE, or as many as the user's --eval-interval makes."""
    config, batch_size = model
    run = replace(planned, **options.given(RECIPE_FIELDS))  # the recipe with the user's options, as it will run
    rate = planned.tokens_per_s
    if run.dropout != config.dropout:
        rate = tokens_per_s(replace(config, dropout=run.dropout), batch_size, placement)
    one_check = (2 if run.ema else 1) * check_seconds(config, run.eval_windows, placement.device)
    if options.eval_interval:
        checks = planned.steps / run.eval_interval
        return rate * (1 - min(MOST_ON_CHECKS, checks * one_check / planned.max_time)), round(checks)
    checks = max(1, min(recipe.CHECKS_PER_RUN, int(CHECKS_SHARE * planned.max_time / max(one_check, 1e-9))))
    return rate * (1 - checks * one_check / planned.max_time), checks


def check_seconds(config: AFTConfig, windows: int, device: torch.device) -> float:
    """Seconds one held-out score of `windows` windows takes a model of `config` on `device`
    (evaluate.window_loss, as a run's checks call it), after one untimed window."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = AFTLM(config).to(device)
        ids = torch.randint(0, config.vocab_size, (windows * (config.context_length + 1) + 1,))
        evaluate.window_loss(model, ids, config.context_length, 1)
        synchronize(device)
        start = time.perf_counter()
        evaluate.window_loss(model, ids, config.context_length, windows)  # a float: it waits for the device
        return time.perf_counter() - start


def _dtype(dtype: str, model: tuple[AFTConfig, int], placement: Placement) -> str:
    """--dtype, or with auto: the device's choice, except on a CPU, where bf16 autocast wins only where
    measured faster (it is on CPUs with bf16 matrix units, and slower on the rest)."""
    if dtype != "auto" or placement.device.type != "cpu":
        return next(name for name, torch_dtype in DTYPES.items() if torch_dtype == placement.dtype)
    speeds = recipe.fastest_of(
        (torch.float32, torch.bfloat16), lambda kind: tokens_per_s(*model, Placement(placement.device, kind))
    )
    return "bf16" if speeds[torch.bfloat16] >= recipe.FASTER_ENOUGH * speeds[torch.float32] else "fp32"
