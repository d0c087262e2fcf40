"""The command line end to end, as a user runs it: train writes a run folder, and a folder that holds no
checkpoint is one error line for sample and eval."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import DEVICE


def run_cli(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    """The real console entry point in a subprocess, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "aftgen", *args],
        capture_output=True,
        text=True,
        input=input,
        env=os.environ.copy(),
        timeout=300,
    )


def test_train_writes_a_checkpoint(tiny_run):
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.model",
        "README.md",
        "metrics.jsonl",
        "training_state.safetensors",
    ):
        assert (tiny_run / name).is_file(), name
    rows = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [20, 40]
    assert {"step", "elapsed", "train_loss", "held_out_nats_per_char", "held_out_bits_per_char"} <= set(rows[0])


def test_train_cli_in_subprocess(tmp_path, corpus):
    out = tmp_path / "run"
    done = run_cli(
        "train", str(corpus), "--out", str(out), "--preset", "tiny", "--max-steps", "10", "--vocab-size", "300",
        "--device", DEVICE,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    again = run_cli("train", str(corpus), "--out", str(out), "--preset", "tiny", "--max-steps", "10")
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_not_a_checkpoint(tmp_path, corpus):
    result = run_cli("sample", "--model", str(tmp_path), "--prompt", "x")
    assert result.returncode == 2 and "not an aftgen checkpoint" in result.stderr
    result = run_cli("eval", "--model", str(tmp_path / "nope"), str(corpus))
    assert result.returncode == 2 and "no such checkpoint" in result.stderr
