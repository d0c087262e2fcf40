"""The command line end to end: train, sample, eval, and bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, make_corpus, on_device
from typer.testing import CliRunner

from aftgen.api import load
from aftgen.cli import app

runner = CliRunner()


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


def test_sample_is_seeded_and_streams_only_text(tiny_run):
    args = ["sample", "--model", str(tiny_run), "--device", DEVICE, "--prompt", "KING:", "-n", "40", "--seed", "3"]
    first, second = runner.invoke(app, args), runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert first.stdout == second.stdout
    assert first.stdout.startswith("KING:")
    other = runner.invoke(app, [*args[:-1], "4"])
    assert other.stdout != first.stdout
    no_echo = runner.invoke(app, [*args, "--no-echo"])
    assert first.stdout == "KING:" + no_echo.stdout


def test_eval_json(tiny_run, corpus):
    result = runner.invoke(app, ["eval", "--model", str(tiny_run), "--device", DEVICE, str(corpus), "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert set(figures) == {"nats_per_token", "nats_per_char", "bits_per_char", "bits_per_byte", "tokens", "chars"}
    assert figures["chars"] == len(corpus.read_text())
    assert 0 < figures["nats_per_char"] < figures["nats_per_token"]


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


def direct_nll(model, ids: list[int]) -> torch.Tensor:
    """Each token's negative log-likelihood from one plain forward pass over the whole sequence."""
    sequence = on_device(torch.tensor([ids]))
    with torch.no_grad():
        logits = model(sequence[:, :-1])[0]
    return F.cross_entropy(logits, sequence[0, 1:], reduction="none").double().cpu()


def test_eval_figures_are_the_mean_negative_log_likelihood(tiny_run, tmp_path):
    model, tokenizer = load(str(tiny_run), device=DEVICE)
    text = make_corpus(6_000, seed=9) + " caf\u00e9 \u65e5\u672c"  # past one 1,024-token chunk; multi-byte characters
    path = tmp_path / "held_out.txt"
    path.write_text(text, encoding="utf-8")
    ids = [tokenizer.bos_id, *tokenizer.encode(text)]
    assert len(ids) > 1024 + 100
    nll = direct_nll(model, ids)
    for extra, windows in (([], [nll]), (["--reset-every", "300"], [])):
        if extra:  # independent windows of 300 predicted tokens, each read from BOS + its own tokens
            windows = [direct_nll(model, ids[start : start + 301]) for start in range(0, len(nll), 300)]
        result = runner.invoke(
            app, ["eval", "--model", str(tiny_run), "--device", DEVICE, "--dtype", "fp32", str(path), "--json", *extra]
        )
        assert result.exit_code == 0, result.output
        figures, total = json.loads(result.stdout), float(torch.cat(windows).sum())
        assert figures["tokens"] == len(ids) - 1 and figures["chars"] == len(text)
        assert figures["nats_per_token"] == pytest.approx(total / (len(ids) - 1), rel=1e-5)
        assert figures["nats_per_char"] == pytest.approx(total / len(text), rel=1e-5)
        assert figures["bits_per_char"] == pytest.approx(total / len(text) / math.log(2), rel=1e-5)
        assert figures["bits_per_byte"] == pytest.approx(total / len(text.encode()) / math.log(2), rel=1e-5)


def test_num_samples_gives_that_many_different_continuations_of_one_prompt(tiny_run):
    args = [
        "sample",
        "--model",
        str(tiny_run),
        "--device",
        DEVICE,
        "-p",
        "KING:",
        "-n",
        "30",
        "--seed",
        "2",
        "--num-samples",
        "3",
    ]
    first, again = runner.invoke(app, args), runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    samples = first.stdout.rstrip("\n").split("\n\n---\n\n")
    assert len(samples) == 3 and all(s.startswith("KING:") for s in samples)
    assert len(set(samples)) == 3  # each continuation draws its own tokens
    assert again.stdout == first.stdout  # and the seed fixes all of them


def test_prompt_from_stdin_or_a_file_equals_the_prompt_option(tiny_run, tmp_path):
    prompt = "KING:\nGood night, sweet \u65e5 lady."
    (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
    common = ["sample", "--model", str(tiny_run), "--device", DEVICE, "-n", "25", "--seed", "4"]
    given = runner.invoke(app, [*common, "--prompt", prompt])
    piped = runner.invoke(app, [*common, "--prompt", "-"], input=prompt)
    from_file = runner.invoke(app, [*common, "--prompt-file", str(tmp_path / "prompt.txt")])
    assert given.exit_code == piped.exit_code == from_file.exit_code == 0, piped.output + from_file.output
    assert given.stdout.startswith(prompt) and len(given.stdout) > len(prompt) + 1
    assert piped.stdout == given.stdout == from_file.stdout


def assert_error_line(result, line: str) -> None:
    """Exit 2, and `line` is the last thing on stderr (no traceback, no internal error)."""
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == line, result.stderr


NOT_UTF8 = "is not valid UTF-8 (an undecodable byte at character {}); give UTF-8 text"


@pytest.mark.parametrize(
    "args, stdin, source, at",
    [
        (["sample", "--prompt", "KING\udcff\udcfe"], None, "--prompt", 4),  # how Python hands over argv's bytes
        (["sample", "--stop", "\udcff"], None, "--stop", 0),
        (["sample", "--prompt", "-"], b"KING:\xff", "stdin", 5),
        (["chat"], b"KING: hail\n\xffNURSE:\n", "stdin line 2", 0),
    ],
    ids=["prompt", "stop", "sample stdin", "chat stdin"],
)
def test_text_that_is_not_utf8_is_one_error_line(tiny_run, args, stdin, source, at):
    result = runner.invoke(app, [*args, "--model", str(tiny_run), "--device", DEVICE, "-n", "3"], input=stdin)
    assert_error_line(result, f"error: {source} {NOT_UTF8.format(at)}")


def test_bytes_that_are_not_utf8_from_a_terminal_or_a_pipe(tiny_run):
    """The real process: the command line's bytes, and stdin decoded strictly (as in a UTF-8 locale)."""
    given = subprocess.run(
        [sys.executable, "-m", "aftgen", "sample", "--prompt", b"\xff\xfe", "--model", str(tiny_run)],
        capture_output=True,
        timeout=300,
    )
    assert given.returncode == 2 and given.stderr.decode().strip() == f"error: --prompt {NOT_UTF8.format(0)}"
    command = [sys.executable, "-m", "aftgen", "chat", "--model", str(tiny_run), "--device", DEVICE, "-n", "3"]
    environment = os.environ | {"PYTHONIOENCODING": "utf-8:strict"}
    piped = subprocess.run(command, input=b"\xff\n", capture_output=True, env=environment, timeout=300)
    assert piped.returncode == 2 and piped.stderr.decode().strip() == f"error: stdin line 1 {NOT_UTF8.format(0)}"


def test_seeds_take_the_range_the_server_takes(tiny_run, corpus, tmp_path):
    from aftgen.generation.controls import SEEDS

    model = ["--model", str(tiny_run), "--device", DEVICE]
    highest = runner.invoke(app, ["sample", *model, "-p", "KING:", "-n", "3", "--seed", str(SEEDS.high)])
    assert highest.exit_code == 0, highest.output
    commands = [
        ["sample", *model],
        ["chat", *model],
        ["prime", str(corpus), "--out", str(tmp_path / "s.safetensors"), *model],
        ["train", str(corpus), "--out", str(tmp_path / "run"), "--threads", "1"],
    ]
    for seed in (SEEDS.high + 1, 1 << 64, -1):
        for args in commands:
            result = runner.invoke(app, [*args, "--seed", str(seed)], input="")
            assert_error_line(result, f"error: --seed must be {SEEDS}, got {seed}")
    assert not (tmp_path / "s.safetensors").exists() and not (tmp_path / "run").exists()
