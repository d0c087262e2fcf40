"""How the benchmarks measure (aftgen/bench/measure.py): timers taking turns and keeping their fastest round,
memory summed over a process tree, and timers that leave the state they start from as it was."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import on_device

from aftgen.bench import measure
from aftgen.model import AFTLM, AFTConfig, tokens_read


def test_timers_take_turns_and_each_keeps_its_fastest_round_per_token(monkeypatch):
    clock, calls = [0.0], []
    costs = {"slow": iter([5.0] * 4 + [3.0] * 4), "fast": iter([1.0] * 8)}  # seconds a call, round after round

    def timer(name: str):
        def run() -> None:
            calls.append(name)
            clock[0] += next(costs[name])

        return run, 3, 2  # three calls a round, two tokens a call

    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    best = measure.fastest_side_by_side({"slow": timer("slow"), "fast": timer("fast")}, rounds=2)
    assert calls == (["slow"] * 4 + ["fast"] * 4) * 2  # an untimed call, then the timed ones, in turn
    assert best == {"slow": 3.0 / 2 * 1e3, "fast": 1.0 / 2 * 1e3}  # ms per token of the fastest round


def test_a_process_trees_memory_is_the_sum_of_its_members():
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '60'])"])
    try:
        deadline = time.monotonic() + 60  # a safety net against a hung start, not a speed requirement
        while len(measure._tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        members = measure._tree(parent.pid)
        assert len(members) == 2 and members[0] == parent.pid
        resident, peak = measure.tree_memory_mb(parent.pid)
        alone = [measure.memory_mb(member) for member in members]
        assert resident == pytest.approx(sum(figures[0] for figures in alone), rel=0.01)
        assert peak == pytest.approx(sum(figures[1] for figures in alone), rel=0.01) and resident > alone[0][0] > 0
    finally:
        for pid in reversed(measure._tree(parent.pid)):
            os.kill(pid, signal.SIGKILL)
        parent.wait()
    assert all(math.isnan(figure) for figure in measure.tree_memory_mb(parent.pid))  # gone: unknown, not zero


def test_the_step_and_prefill_timers_leave_their_state_and_read_until_stops_at_the_context():
    torch.manual_seed(0)
    config = AFTConfig(vocab_size=50, n_layer=1, n_embd=16, n_head=2, window=4, context_length=16)
    model = on_device(AFTLM(config)).eval()
    ids = on_device(torch.randint(0, 50, (1, 10)))
    state = measure.read_until(model, ids, model.initial_state(1), 35)
    assert tokens_read(state) == 35  # three whole chunks and the first 5 tokens of a fourth
    for run, calls, tokens in (measure.step_timer(model.step, state), measure.prefill_timer(model.prefill, ids, state)):
        with torch.inference_mode():
            run()
            run()
        assert tokens_read(state) == 35 and calls * tokens > 0
