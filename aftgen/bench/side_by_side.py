"""`aftgen bench side-by-side`: aftgen jobs run together on one machine, each against itself alone.

Three cases, each run twice in one bench: with the cores shared (aftgen.cores: the processes find each
other and split the cores) and as every process did before (AFTGEN_SOLO: each takes every core).
- one training alone, the reference;
- two trainings started together: their steps/s added up, over one alone's;
- a server answering 8 streaming clients while a training runs: each one's speed over its own alone.
Every job is an `aftgen` child process with the same command a user would type; the trainings are
`aftgen train CORPUS --preset small --max-time SECONDS`, and their speed is steps over trained seconds
from training.json.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from aftgen.bench.options import BenchServeOptions
from aftgen.bench.serve import ServerProcess, read_log, run_phase
from aftgen.bench.targets import TARGETS, Row
from aftgen.cores import SOLO_VARIABLE
from aftgen.errors import AftgenError
from aftgen.record import read_run_files

MODES = {"shared": {}, "every core": {SOLO_VARIABLE: "1"}}  # the environment each mode's processes get
STREAMS, TOKENS = 8, 128  # the server's load: rounds of 8 streaming clients, each asking for 128 tokens
TRAINING_STARTED = "parameters, vocabulary"  # in the line a training prints as its loop begins (training/loop.py)


class Training:
    """`aftgen train CORPUS --preset small --max-time SECONDS` in a child process, into a folder of its own."""

    def __init__(self, corpus: Path, seconds: float, folder: Path, env: dict[str, str]) -> None:
        self.out, self.log = folder / "run", folder / "train.log"
        command = [sys.executable, "-m", "aftgen", "train", str(corpus), "--preset", "small",
                   "--max-time", str(seconds), "--out", str(self.out), "--overwrite"]  # fmt: skip
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)

    def started(self) -> bool:
        return TRAINING_STARTED in read_log(self.log)

    def running(self) -> bool:
        return self.process.poll() is None

    def steps_per_s(self) -> float:
        """Wait for the run to end; its steps over its trained seconds."""
        if self.process.wait() != 0:
            raise AftgenError(f"bench side-by-side: a training failed: {read_log(self.log)[-500:]}")
        info = read_run_files(self.out)[0]
        return info["step"] / info["elapsed"]


def trainings(corpus: Path, seconds: float, count: int, env: dict[str, str]) -> list[float]:
    """Steps/s of `count` trainings started together."""
    with tempfile.TemporaryDirectory(prefix="aftgen-side-by-side-") as folder:
        folders = [Path(folder) / str(i) for i in range(count)]
        for path in folders:
            path.mkdir()
        jobs = [Training(corpus, seconds, path, env) for path in folders]
        return [job.steps_per_s() for job in jobs]


def serve_rounds(server: ServerProcess, go_on: Callable[[], bool]) -> float:
    """Tokens/s over rounds of STREAMS clients, while go_on() holds at the start of a round."""
    tokens, seconds = 0, 0.0
    while go_on():
        began = time.perf_counter()
        timings = asyncio.run(run_phase(server.host, server.port, STREAMS, TOKENS))
        tokens, seconds = tokens + sum(t.tokens for t in timings), seconds + time.perf_counter() - began
    return tokens / seconds if seconds else float("nan")


def serving_beside_training(corpus: Path, seconds: float, env: dict[str, str], log) -> tuple[float, float, float]:
    """The server's tokens/s alone, then while a training runs, and that training's steps/s."""
    with ServerProcess(BenchServeOptions(tokens=TOKENS), env) as server:
        asyncio.run(run_phase(server.host, server.port, STREAMS, 16))  # untimed: one-off costs of the first calls
        until = time.monotonic() + seconds / 2
        alone = serve_rounds(server, lambda: time.monotonic() < until)
        with tempfile.TemporaryDirectory(prefix="aftgen-side-by-side-") as folder:
            job = Training(corpus, seconds, Path(folder), env)
            while job.running() and not job.started():  # the server waits while the training starts
                time.sleep(0.2)
            together = serve_rounds(server, job.running)
            training = job.steps_per_s()
    log(f"  serving {STREAMS} streams: {alone:,.0f} tokens/s alone, {together:,.0f} beside a training")
    return alone, together, training


def bench_side_by_side(corpus: Path, seconds: float, log=print) -> list[Row]:
    """Every case in both modes; rows of speeds and ratios, the shared mode's judged against the targets."""
    rows: list[Row] = []
    for mode, extra in MODES.items():
        env = {**os.environ, **extra}
        log(f"bench side-by-side: {mode}")
        alone = trainings(corpus, seconds, 1, env)[0]
        pair = trainings(corpus, seconds, 2, env)
        log(f"  training: {alone:.2f} steps/s alone, {pair[0]:.2f} + {pair[1]:.2f} two together")
        serve_alone, serve_together, train_beside = serving_beside_training(corpus, seconds, env, log)
        log(f"  training beside the server: {train_beside:.2f} steps/s")
        figures = {
            "two trainings together / one alone": sum(pair) / alone,
            "training beside a server / alone": train_beside / alone,
            "server beside a training / alone": serve_together / serve_alone,
        }
        rows += [{"measure": "training alone", "value": round(alone, 3), "unit": "steps/s", "mode": mode}]
        rows += [
            {"measure": "server alone, 8 streams", "value": round(serve_alone, 1), "unit": "tokens/s", "mode": mode}
        ]
        if mode == "shared":
            rows += [TARGETS[measure].judge(value) | {"mode": mode} for measure, value in figures.items()]
        else:
            rows += [
                {"measure": measure, "value": round(value, 4), "unit": "x", "mode": mode}
                for measure, value in figures.items()
            ]
    shared, before = (row["value"] for row in rows if row["measure"] == "training alone")
    return rows + [TARGETS["training alone, shared / every core"].judge(shared / before)]
