"""`aftgen bench side-by-side` (aftgen/bench/side_by_side.py): each case's speeds become ratios to the same job
alone, judged against the targets where the cores are shared, and the two modes compared."""

from __future__ import annotations

import itertools
import math

import pytest

from aftgen.bench import side_by_side
from aftgen.bench.targets import TARGETS
from aftgen.cores import SOLO_VARIABLE

# steps/s of one training alone, of each of two together, and tokens/s of the server alone and beside a training
SPEEDS = {"shared": (2.0, (0.9, 0.8), (1000.0, 500.0, 1.0)), "every core": (2.5, (0.5, 0.5), (1200.0, 300.0, 0.5))}
CASES = ("two trainings together / one alone", "training beside a server / alone", "server beside a training / alone")


def mode_of(env: dict[str, str]) -> str:
    return "every core" if env.get(SOLO_VARIABLE) == "1" else "shared"


def test_each_cases_speed_is_a_ratio_to_its_job_alone_judged_where_the_cores_are_shared(monkeypatch):
    monkeypatch.delenv(SOLO_VARIABLE, raising=False)
    started = []

    def trainings(corpus, seconds, count, env):
        started.append((mode_of(env), count))
        alone, pair, _ = SPEEDS[mode_of(env)]
        return [alone] if count == 1 else list(pair)

    monkeypatch.setattr(side_by_side, "trainings", trainings)
    monkeypatch.setattr(side_by_side, "serving_beside_training", lambda corpus, s, env, log: SPEEDS[mode_of(env)][2])
    rows = side_by_side.bench_side_by_side("corpus.txt", 40.0, log=lambda line: None)
    assert started == [("shared", 1), ("shared", 2), ("every core", 1), ("every core", 2)]
    by_mode = {(row["measure"], row.get("mode")): row for row in rows}
    judged = {name: by_mode[TARGETS[name].measure, "shared"] for name in CASES}
    assert [judged[name]["value"] for name in CASES] == [pytest.approx(0.85), 0.5, 0.5]
    assert [judged[name]["ok"] for name in CASES] == [True, True, True]  # >= 0.8, 0.35 and 0.35
    assert [by_mode[name, "every core"]["value"] for name in CASES] == [0.4, 0.2, 0.25]
    assert all("ok" not in by_mode[name, "every core"] for name in CASES)  # measured, not judged
    assert by_mode["server alone, 8 streams", "every core"]["value"] == 1200.0
    last = rows[-1]
    assert last["measure"] == "training alone, cores shared / every core" and last["value"] == pytest.approx(0.8)
    assert last["ok"] is False  # < 0.95


def test_serving_rounds_count_every_streams_tokens_until_told_to_stop(monkeypatch):
    class Timing:
        tokens = side_by_side.TOKENS

    async def run_phase(host, port, streams, tokens):
        return [Timing()] * streams

    class Server:
        host, port = "127.0.0.1", 1

    clock = itertools.count(0.0, 0.5)  # each round takes half a second
    monkeypatch.setattr(side_by_side, "run_phase", run_phase)
    monkeypatch.setattr(side_by_side.time, "perf_counter", lambda: next(clock))
    rounds = iter([True, True, False])
    assert side_by_side.serve_rounds(Server(), lambda: next(rounds)) == side_by_side.STREAMS * side_by_side.TOKENS * 2
    assert next(rounds, "spent") == "spent"  # it asked before each round and stopped at the first no
    assert math.isnan(side_by_side.serve_rounds(Server(), lambda: False))
