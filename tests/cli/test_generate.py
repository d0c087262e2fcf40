"""`aftgen sample`, `chat` and `prime` (aftgen/cli/generate.py): seeded text, several samples, the prompt from
stdin or a file, text that is not UTF-8 and seeds out of range as one error line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import DEVICE
from typer.testing import CliRunner

from aftgen.cli import app

runner = CliRunner()


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
