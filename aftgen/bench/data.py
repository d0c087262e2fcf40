"""`aftgen bench data`: what preparing and training on a large corpus costs on this machine.

Each phase runs as the real command in a fresh process, so its peak resident memory (from wait4,
per process) is that phase's alone: `aftgen prepare` into an empty cache (tokenizer and token
files), then `aftgen train` on the prepared corpus for a few steps, timed from its start to its first
training step, and then through its final eval of the held-out part.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from aftgen.bench.targets import TARGETS, Row
from aftgen.corpus.sources import find_files
from aftgen.errors import AftgenError

TRAIN_STEPS = 10


def _run(command: list[str], env: dict, log: Callable[[str], None]) -> dict:
    """Run a command to its end: wall and CPU seconds, peak RSS, its stderr lines with their times."""
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in process.stderr:
        lines.append((time.monotonic() - start, line.rstrip()))
        log(f"    {line.rstrip()}")
    stdout = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)  # this child's own peak, not the largest of all children
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise AftgenError(f"{' '.join(command[2:5])}... failed ({process.returncode}): {lines[-1][1] if lines else ''}")
    return {
        "seconds": time.monotonic() - start,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "peak_mb": usage.ru_maxrss / 1024,
        "lines": lines,
        "stdout": stdout,
    }


def _first(lines: list[tuple[float, str]], prefix: str) -> float:
    for seconds, line in lines:
        if line.startswith(prefix):
            return seconds
    raise AftgenError(f"benchmark: no '{prefix}' line in the training output")


def bench_corpus(corpus: Path, megabytes: float, steps: int, log: Callable[[str], None]) -> list[Row]:
    """Prepare `corpus` (`megabytes` of text) in an empty cache, then train on it: the rows of one corpus."""
    aftgen = [sys.executable, "-m", "aftgen"]
    with tempfile.TemporaryDirectory(prefix="aftgen-bench-data-") as folder:
        env = {**os.environ, "AFTGEN_CACHE": folder}
        log(f"{corpus}: {megabytes:,.1f} MB; load average {os.getloadavg()[0]:.2f}; aftgen prepare ...")
        prepared = _run([*aftgen, "prepare", str(corpus)], env, log)
        log(f"{corpus}: aftgen train on the prepared corpus, {steps} steps ...")
        command = ["train", str(corpus), "--out", f"{folder}/run", "--max-steps", str(steps)]
        trained = _run([*aftgen, *command, "--eval-interval", "1", "--eval-windows", "1"], env, log)
    first_step = _first(trained["lines"], "step 1:")
    final_eval = _first(trained["lines"], "done:") - _first(trained["lines"], f"step {steps}:")
    where = {"corpus": corpus.name, "MB": round(megabytes, 1)}
    rows = [
        _row("prepare: time", prepared["seconds"], "s"),
        TARGETS["prepare speed"].judge(megabytes / prepared["seconds"]),
        _row("prepare: cores busy", prepared["cpu_seconds"] / prepared["seconds"], "cores"),
        TARGETS["prepare memory"].judge(prepared["peak_mb"]),
        TARGETS["first step"].judge(first_step),
        TARGETS["train memory"].judge(trained["peak_mb"]),
        _row("train: final eval", final_eval, "s"),
    ]
    return [row | where for row in rows]


def _row(measure: str, value: float, unit: str) -> Row:
    return {"measure": measure, "value": round(value, 2), "unit": unit}


def bench_data(corpora: list[Path], steps: int = TRAIN_STEPS, log: Callable[[str], None] = print) -> list[Row]:
    """Rows for each corpus in turn; with several, how far apart their peak memories are."""
    if steps < 1:
        raise AftgenError(f"--steps must be >= 1, got {steps}")
    # The files aftgen reads (folders: *.txt, hidden ones left out), found before any work: a bad path is one error.
    sizes = {corpus: sum(path.stat().st_size for path in find_files([corpus])) / 1e6 for corpus in corpora}
    rows = [row for corpus, megabytes in sizes.items() for row in bench_corpus(corpus, megabytes, steps, log)]
    rows.append(_row("load average (1 min) at the end", os.getloadavg()[0], ""))
    for phase in ("prepare", "train") if len(corpora) > 1 else ():
        peaks = [row["value"] for row in rows if row["measure"] == f"{phase}: peak RSS"]
        rows.append(TARGETS[f"{phase} memory spread"].judge(max(peaks) / min(peaks) - 1))
    return rows
