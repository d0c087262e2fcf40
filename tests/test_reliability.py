"""Reliability: no work lost (kill -9, signals, NaN, full disk), no traceback for bad input, nothing unsafe loaded."""

from __future__ import annotations

import errno
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tokenize
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from bad_input import JSON, assert_one_error, invoke, retensor
from conftest import DEVICE, make_corpus, train_tiny
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import aftgen
from aftgen.checkpoint import (
    CHECKPOINT_FILES,
    WEIGHTS,
    load_checkpoint,
)
from aftgen.errors import AftgenError
from aftgen.model import MAX_PARAMETERS, AFTConfig
from aftgen.record import TRAINING_INFO, TRAINING_STATE
from aftgen.training.loop import TrainingInterrupted

SOURCE = Path(aftgen.__file__).parent


pytestmark = pytest.mark.usefixtures("one_thread")


def trained_step(out: Path) -> int:
    return json.loads((out / TRAINING_INFO).read_text())["step"]


def temporaries(out: Path) -> list[Path]:
    return list(out.glob(".*.tmp"))


def metric_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# --- Training never loses work --------------------------------------------------------------------


def training_command(corpus: Path, out: Path, *extra: str) -> list[str]:
    """`aftgen train` checkpointing every 2 steps, with no end in sight unless `extra` sets one."""
    command = [sys.executable, "-m", "aftgen", "train", str(corpus), "--out", str(out), "--preset", "tiny"]
    command += [
        "--vocab-size",
        "400",
        "--max-steps",
        "1000000",
        "--eval-interval",
        "2",
        "--threads",
        "1",
        "--device",
        DEVICE,
    ]
    return [*command, *extra]


def spawn_training(corpus: Path, out: Path, *extra: str) -> subprocess.Popen:
    command = training_command(corpus, out, *extra)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())


def wait_for_checkpoint_after(out: Path, step: int, process: subprocess.Popen) -> int:
    """Block until the run in `out` has saved a step beyond `step`; return it."""
    deadline = time.monotonic() + 180  # a safety net against a hung process, not a speed requirement
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"training exited early ({process.returncode}): {process.communicate()[1]}")
        if (out / TRAINING_INFO).exists() and trained_step(out) > step:
            return trained_step(out)
        time.sleep(0.02)
    process.kill()
    pytest.fail("no checkpoint appeared")


def test_sigkill_at_random_points_loses_nothing(tmp_path, corpus, tiny_run):
    out, rng, step = tmp_path / "run", random.Random(6), -1
    for kill in range(3):
        process = spawn_training(corpus, out, *(["--resume"] if kill else []))
        step = wait_for_checkpoint_after(out, step, process)  # on a resume: it continued from the last kill
        time.sleep(rng.uniform(0.0, 0.8))  # lands in a step, an eval or the middle of a save
        process.kill()
        process.communicate()
        model, tokenizer = aftgen.load(out)
        assert model.config.vocab_size == tokenizer.vocab_size
        assert all(torch.isfinite(p).all() for p in model.parameters())
        step = trained_step(out)
    train_tiny(corpus, out, resume=True, max_steps=step + 2)
    assert trained_step(out) == step + 2
    assert temporaries(out) == []  # what the kills left half-written was cleaned up
    assert metric_steps(out) == sorted(set(metric_steps(out)))  # a check redone after a kill is there once
    aftgen.load(out)


def interrupt_at(step: int):
    """An on_eval callback that sends this process SIGINT (a Ctrl-C) at `step`."""

    def on_eval(row: dict) -> None:
        if row["step"] == step:
            os.kill(os.getpid(), signal.SIGINT)

    return on_eval


@pytest.mark.parametrize("ema, optimizer", [(0.0, "adamw"), (0.8, "adamw"), (0.8, "muon")])
def test_resume_is_exact(tmp_path, corpus, tiny_run, ema, optimizer):
    """N steps in one go == k steps, Ctrl-C, --resume for the rest: schedule, data order, dropout, the
    optimiser's state (both of Muon's parts) and the weight average (what --ema publishes) all restored."""
    options = dict(max_steps=10, eval_interval=2, dropout=0.1, warmup_steps=3, ema=ema, optimizer=optimizer)
    options |= dict(keep_best=False)  # the last step's weights, compared
    train_tiny(corpus, tmp_path / "straight", **options)
    with pytest.raises(TrainingInterrupted):
        train_tiny(corpus, tmp_path / "resumed", on_eval=interrupt_at(4), **options)
    assert trained_step(tmp_path / "resumed") == 4
    train_tiny(corpus, tmp_path / "resumed", resume=True, **options)
    straight, resumed = load_file(tmp_path / "straight" / WEIGHTS), load_file(tmp_path / "resumed" / WEIGHTS)
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], atol=1e-6, rtol=0, msg=name)


def test_a_second_ctrl_c_stops_at_once_without_saving_again(tmp_path, corpus, tiny_run):
    """One Ctrl-C saves and stops; a second one, before that save, stops at once and writes nothing more."""

    def ctrl_c_twice(row: dict) -> None:
        if row["step"] == 4:  # the held-out check of step 4 comes before its checkpoint
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train_tiny(corpus, out, on_eval=ctrl_c_twice, max_steps=10)
    assert trained_step(out) == 2  # neither step 4's checkpoint nor the save on stopping was written
    assert temporaries(out) == []
    aftgen.load(out)


def test_resume_with_more_steps_continues_a_finished_run(tmp_path, corpus, tiny_run):
    out = train_tiny(corpus, tmp_path / "run", max_steps=4)
    train_tiny(corpus, out, max_steps=8, resume=True)
    assert trained_step(out) == 8
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 4, 6, 8]


@pytest.mark.parametrize("signals", [["SIGINT"], ["SIGTERM"], ["SIGINT", "SIGINT"]])
def test_signals_save_and_exit_130(tmp_path, corpus, tiny_run, signals):
    out = tmp_path / "run"
    process = spawn_training(corpus, out)
    wait_for_checkpoint_after(out, 0, process)
    for name in signals:  # a second Ctrl-C soon after the first exits at once, in the middle of whatever
        process.send_signal(getattr(signal, name))
        time.sleep(0.05)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    if len(signals) == 1:
        assert re.search(
            rf"{signals[0]}: saved step (\d+) to {re.escape(str(out))}; continue with: .* --resume", stderr
        ), stderr
        step = int(re.search(r"saved step (\d+)", stderr).group(1))
        assert trained_step(out) == step and stdout.strip() == str(out)
    else:
        assert "interrupted" in stderr or "saved step" in stderr
    aftgen.load(out)
    train_tiny(corpus, out, resume=True, max_steps=trained_step(out) + 2)


def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(tmp_path, corpus, tiny_run):
    """A huge learning rate: the loss goes NaN, the last checkpoint (with finite weights) stays."""
    out = tmp_path / "run"
    with pytest.raises(AftgenError, match=r"loss became NaN or inf at step \d+") as caught:
        train_tiny(corpus, out, lr=1e3, warmup_steps=0, max_steps=40)
    message = str(caught.value)
    assert "lower learning rate (--lr " in message
    kept = int(re.search(r"last good checkpoint \(step (\d+)\)", message).group(1))
    assert trained_step(out) == kept
    model, _ = load_checkpoint(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_broken_weights_never_overwrite_a_checkpoint(tmp_path, corpus, tiny_run, monkeypatch):
    """Gradients that turn the weights NaN right before a save: the save is refused, step 2 stays."""
    clip = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def poisoned_clip(parameters, max_norm):
        parameters = list(parameters)
        calls["n"] += 1
        if calls["n"] == 4:  # step 4 is a checkpoint step
            for p in parameters:
                p.grad.fill_(float("nan"))
        return clip(parameters, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned_clip)
    out = tmp_path / "run"
    with pytest.raises(AftgenError, match=r"weights became NaN or inf at step 4; the last good checkpoint \(step 2\)"):
        train_tiny(corpus, out)
    assert trained_step(out) == 2
    model, _ = load_checkpoint(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, corpus, tiny_run, monkeypatch):
    out = tmp_path / "run"
    before: dict[str, bytes] = {}
    fsync = os.fsync

    def disk_fills_at_step_4(row: dict) -> None:
        if row["step"] == 4:  # the save of step 2 is complete; the disk is full from now on
            before.update(
                {name: (out / name).read_bytes() for name in (*CHECKPOINT_FILES, TRAINING_STATE, TRAINING_INFO)}
            )

            def full(fd):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(os, "fsync", full)

    with pytest.raises(AftgenError, match="disk full while writing .*; the previous version is intact"):
        train_tiny(corpus, out, on_eval=disk_fills_at_step_4)
    monkeypatch.setattr(os, "fsync", fsync)
    assert {name: (out / name).read_bytes() for name in before} == before
    assert temporaries(out) == []
    load_checkpoint(out)
    train_tiny(corpus, out, resume=True)  # space freed: carry on from step 2
    assert trained_step(out) == 8


def test_a_folder_holding_another_run_is_not_overwritten(tmp_path, corpus, tiny_run):
    with pytest.raises(AftgenError, match="already holds a run"):
        train_tiny(corpus, tiny_run)
    downloaded = tmp_path / "downloaded"  # a checkpoint without any training files
    downloaded.mkdir()
    for name in CHECKPOINT_FILES:
        shutil.copy(tiny_run / name, downloaded / name)
    with pytest.raises(AftgenError, match="already holds a run"):
        train_tiny(corpus, downloaded)
    with pytest.raises(AftgenError, match="no training state to resume"):
        train_tiny(corpus, downloaded, resume=True)
    train_tiny(corpus, downloaded, overwrite=True, max_steps=2)
    assert trained_step(downloaded) == 2


def test_a_failed_save_never_repeats_a_held_out_check(tmp_path, corpus, tiny_run, monkeypatch):
    """Step 4's row is in metrics.jsonl but its checkpoint failed: the resumed run checks step 4 again,
    and the row is there once."""
    from aftgen.training import run_folder

    save = run_folder.save_training_state

    def fails_at_step_4(folder, model, optimizer, generator, info, average=None):
        if info["step"] == 4:
            raise AftgenError("disk full")
        save(folder, model, optimizer, generator, info, average)

    monkeypatch.setattr(run_folder, "save_training_state", fails_at_step_4)
    out = tmp_path / "run"
    with pytest.raises(AftgenError, match="disk full"):
        train_tiny(corpus, out)
    assert metric_steps(out) == [2, 4] and trained_step(out) == 2
    monkeypatch.setattr(run_folder, "save_training_state", save)
    train_tiny(corpus, out, resume=True)
    assert metric_steps(out) == [2, 4, 6, 8]


def test_two_trainers_into_one_folder_one_is_refused(tmp_path, corpus, tiny_run, capsys):
    from aftgen.files import LOCK

    out = tmp_path / "run"
    first, second = spawn_training(corpus, out), spawn_training(corpus, out)
    deadline = time.monotonic() + 180  # a safety net against a hung process, not a speed requirement
    while first.poll() is None and second.poll() is None:
        if time.monotonic() > deadline:
            first.kill(), second.kill()
            pytest.fail("neither trainer was refused")
        time.sleep(0.05)
    refused, running = (first, second) if first.poll() is not None else (second, first)
    errors = [line for line in refused.communicate()[1].splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1, errors
    assert f"{out} is being written by another aftgen process (PID {running.pid})" in errors[0]
    wait_for_checkpoint_after(out, 0, running)
    running.kill()  # no time to remove its lock
    running.communicate()
    assert (out / LOCK).read_text() == f"{running.pid}\n"
    train_tiny(corpus, out, resume=True, max_steps=trained_step(out) + 2)
    assert f"was locked by process {running.pid}, which ended without unlocking it" in capsys.readouterr().err
    assert not (out / LOCK).exists()


# --- Bad input: exit code 2, one error line, no traceback ------------------------------------------


def write_bad_corpora(folder: Path) -> None:
    latin1 = make_corpus(6000, seed=3).replace("e", "\xe9")
    files = {
        "empty.txt": b"",
        "spaces.txt": b"   \n\n\t \r\n",
        "binary.bin": bytes(range(256)) * 4,
        "utf16.txt": make_corpus(2000).encode("utf-16"),
        "latin1.txt": latin1.encode("latin-1"),
        "small.txt": b"tiny corpus\n",
        "short.txt": make_corpus(3000, seed=4).encode(),
    }
    for name, content in files.items():
        (folder / name).write_bytes(content)
    (folder / "folder").mkdir()


CORPUS_CASES = [
    ("missing.txt", [], "no such file"),
    ("folder", [], r"folder: no files matching '\*\.txt' in this folder; pass --glob PATTERN"),
    ("empty.txt", [], "empty"),
    ("spaces.txt", [], "only whitespace"),
    ("binary.bin", [], "binary"),
    ("utf16.txt", [], "binary.*--encoding utf-16"),
    ("latin1.txt", [], r"not valid utf-8 .*--encoding or --errors replace"),
    ("latin1.txt", ["--encoding", "klingon"], "unknown encoding"),
    ("small.txt", [], "too small"),
    ("short.txt", ["--context-length", "8192", "--window", "8"], "too small: .* fewer than one sequence"),
]


@pytest.mark.parametrize("name,extra,message", CORPUS_CASES, ids=[f"{c[0]}{'+' if c[1] else ''}" for c in CORPUS_CASES])
def test_bad_corpus(tmp_path, name, extra, message):
    write_bad_corpora(tmp_path)
    result = invoke("train", tmp_path / name, "--out", tmp_path / "run", "--preset", "tiny", "--max-steps", "2",
                    "--vocab-size", "300", "--threads", "1", *extra)  # fmt: skip
    assert_one_error(result, message)


OPTION_CASES = [
    (["--max-steps", "0"], "--max-steps must be positive"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--batch-size", "0"], "--batch-size must be positive"),
    (["--layers", "0"], "--layers must be positive"),
    (["--width", "-8"], "--width must be positive"),
    (["--heads", "0"], "--heads must be positive"),
    (["--context-length", "0"], "--context-length must be positive"),
    (["--window", "-1"], r"window \(-1\) must be between 0 and context_length"),
    (["--window", "64"], r"window \(64\) must be between 0 and context_length \(32\)"),
    (["--width", "30", "--heads", "4"], "must be a multiple of n_head"),
    (["--dropout", "1.5"], "dropout must be in"),
    (["--layers", "100000"], "must be at most"),
    (["--width", "60000", "--layers", "200"], "parameters, more than aftgen's limit"),
    (["--mixer", "lstm"], "unknown --mixer 'lstm'"),
    (["--preset", "huge"], "unknown --preset 'huge'"),
    (["--max-time", "-5"], "duration must be positive"),
    (["--max-time", "soon"], "cannot read duration"),
    (["--errors", "maybe"], "--errors must be strict, replace or ignore"),
    (["--warmup-steps", "-1"], "--warmup-steps must not be negative"),
    (["--vocab-size", "10"], "at least 260"),
    (["--tokenizer-type", "wordpiece"], "unknown tokenizer type"),
    (["--weights-dtype", "fp8"], "unknown --weights-dtype 'fp8'"),
    (["--eval-windows", "0"], "--eval-windows must be positive"),
    (["--ema", "1"], r"--ema must be in \[0, 1\)"),
    (["--patience", "3", "--no-keep-best"], "--patience needs --keep-best"),
    (["--patience", "-1", "--keep-best"], "--patience must not be negative"),
]


@pytest.mark.parametrize("extra,message", OPTION_CASES, ids=[" ".join(c[0]) for c in OPTION_CASES])
def test_bad_training_option(tmp_path, corpus, extra, message):
    result = invoke(
        "train", corpus, "--out", tmp_path / "run", "--preset", "tiny", "--max-steps", "2", "--threads", "1", *extra
    )
    assert_one_error(result, message)
    assert not (tmp_path / "run" / TRAINING_INFO).exists()


def test_unwritable_run_folder_is_refused_before_any_work(tmp_path, corpus):
    (tmp_path / "file").write_text("not a folder")
    result = invoke("train", corpus, "--out", tmp_path / "file" / "run", "--preset", "tiny", "--threads", "1")
    assert_one_error(result, "cannot create folder .*Not a directory")


def test_odd_but_valid_text_trains(tmp_path):
    """A huge single line, mixed line endings and a few stray NUL bytes are just text."""
    text = make_corpus(20_000, seed=8)
    odd = (
        text[:8000].replace("\n", " ")
        + "\r\n".join(text[8000:14000].splitlines())
        + "\r"
        + text[14000:].replace("\n", "\x00", 5)
    )
    path = tmp_path / "odd.txt"
    path.write_bytes(odd.encode())
    result = invoke(
        "train",
        path,
        "--out",
        tmp_path / "run",
        "--preset",
        "tiny",
        "--max-steps",
        "2",
        "--vocab-size",
        "300",
        "--threads",
        "1",
    )
    assert result.exit_code == 0, result.output
    _, tokenizer = load_checkpoint(tmp_path / "run")
    assert tokenizer.decode(tokenizer.encode(odd)) == odd


@pytest.mark.parametrize("way_out", [["--encoding", "latin-1"], ["--errors", "replace"]])
def test_non_utf8_corpus_has_a_way_out(tmp_path, way_out):
    write_bad_corpora(tmp_path)
    result = invoke("train", tmp_path / "latin1.txt", "--out", tmp_path / "run", "--preset", "tiny", "--max-steps", "2",
                    "--vocab-size", "300", "--threads", "1", *way_out)  # fmt: skip
    assert result.exit_code == 0, result.output


def _with_metrics_row(row: dict):
    def damage(out: Path) -> None:
        with open(out / "metrics.jsonl", "a") as metrics:
            metrics.write(json.dumps(row) + "\n")

    return damage


def _with_run_description(text: str):
    """The training state's header describing the run as `text` (JSON, or not)."""

    def damage(out: Path) -> None:
        from aftgen.checkpoint import safetensors_metadata

        metadata = safetensors_metadata(out / TRAINING_STATE) | {"info": text}
        save_file(load_file(out / TRAINING_STATE), out / TRAINING_STATE, metadata=metadata)

    return damage


def _without_settings(out: Path) -> None:
    from aftgen.checkpoint import safetensors_metadata

    info = json.loads(safetensors_metadata(out / TRAINING_STATE)["info"])
    _with_run_description(json.dumps({key: value for key, value in info.items() if key != "settings"}))(out)


@pytest.mark.parametrize(
    "damage, message",
    [
        (_with_metrics_row({"held_out_nats_per_char": 2.0}), r"metrics.jsonl: line 3: .*`step`"),
        (_with_metrics_row({"step": "4", "held_out_nats_per_char": 2.0}), r"metrics.jsonl: line 3: .*\$.step"),
        (_without_settings, "cannot read training state .*settings lack"),
        (_with_run_description("[]"), "cannot read training state .*not a JSON object"),
        (_with_run_description("[" * 100_000 + "]" * 100_000), "cannot read training state .*recursion"),
    ],
    ids=["metrics row without step", "string step", "no settings", "a list", "nested 100k deep"],
)
def test_damaged_run_records_on_resume_are_one_error(tmp_path, corpus, tiny_run, damage, message):
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)
    damage(out)
    assert_one_error(invoke("train", corpus, "--out", out, "--resume", "--threads", "1"), message)


def test_internal_error_is_one_line_and_a_log(tmp_path, tiny_run, monkeypatch):
    import aftgen.generation.loop

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(aftgen.generation.loop, "sample_text", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = invoke("sample", "--model", tiny_run, "--prompt", "KING:")
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    found = re.fullmatch(
        r"error: internal error: RuntimeError: boom \(traceback in (\S+); --debug shows it\)", lines[0]
    )
    assert found, lines[0]
    log = Path(found.group(1)).read_text()
    assert "Traceback (most recent call last)" in log and "RuntimeError: boom" in log
    debug = invoke("--debug", "sample", "--model", tiny_run, "--prompt", "KING:")
    assert isinstance(debug.exception, RuntimeError) and str(debug.exception) == "boom"  # raised, so Python prints it


# --- Loading is safe --------------------------------------------------------------------------------

UNSAFE = [
    (re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|joblib|marshal)\b", re.M), "a pickle-family import"),
    (re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy allow_pickle=True"),
    (re.compile(r"trust_remote_code\s*=\s*True"), "trust_remote_code=True"),
    (re.compile(r"(?<!def )(?<![\w.])(eval|exec)\("), "eval/exec"),
]


def code_of(source: str) -> str:
    """A module's code with its strings and comments blanked out: the model card's usage lines may name
    trust_remote_code=True for transformers' users; aftgen's own calls must not."""
    lines = source.splitlines(keepends=True)
    for token in reversed(list(tokenize.generate_tokens(io.StringIO(source).readline))):
        if token.type in (tokenize.STRING, tokenize.COMMENT):
            (first, start), (last, end) = token.start, token.end
            lines[first - 1 : last] = [lines[first - 1][:start] + '""' + lines[last - 1][end:]]
    return "".join(lines)


def test_no_unsafe_loading_in_the_source():
    sources = sorted(SOURCE.rglob("*.py"))
    assert len(sources) > 5
    found = [f"{path.name}: {what}" for path in sources for pattern, what in UNSAFE
             if pattern.search(code_of(path.read_text()))]  # fmt: skip
    assert found == []


def test_the_unsafe_pattern_scan_can_fail():
    samples = [
        "import pickle",
        "from pickle import loads",
        "torch.load(path)",
        "np.load(f, allow_pickle=True)",
        "exec(code)",
    ]
    assert all(any(p.search(code_of(sample)) for p, _ in UNSAFE) for sample in samples)
    assert any(p.search(code_of("AutoModel.from_pretrained(x, trust_remote_code=True)")) for p, _ in UNSAFE)
    assert not any(p.search("torch.load(path, weights_only=True)") for p, _ in UNSAFE)


FIELD_NAMES = [f.name for f in fields(AFTConfig)]
NEAR_VALID = st.fixed_dictionaries(
    {"vocab_size": st.integers(1, 2**70) | JSON},
    optional={
        name: st.integers(-3, 2**70) | st.integers(0, 300) | JSON for name in FIELD_NAMES if name != "vocab_size"
    },
)


@settings(max_examples=300, deadline=None)
@given(JSON | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8), JSON, max_size=12) | NEAR_VALID)
def test_config_validation_on_arbitrary_json(data):
    try:
        config = AFTConfig.from_dict(data)
    except AftgenError:
        return
    assert AFTConfig.from_dict(config.to_dict()) == config
    assert config.approximate_parameters() <= MAX_PARAMETERS


def _socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))  # the socket file stays after the socket closes


def _link_to_a_device(path: Path) -> None:
    path.symlink_to(os.devnull)  # a device through a link: the write would replace the link, never /dev/null


@pytest.mark.parametrize(
    "make, kind",
    [(os.mkfifo, "a FIFO"), (_socket, "a socket"), (Path.mkdir, "a folder"), (_link_to_a_device, "a device")],
    ids=["fifo", "socket", "folder", "device"],
)
def test_a_state_file_onto_what_is_not_a_file_is_refused_and_leaves_it(tmp_path, tiny_run, make, kind):
    target = tmp_path / "target"
    make(target)
    before = os.lstat(target)
    result = invoke("sample", "--model", tiny_run, "--prompt", "KING:", "-n", "2", "--save-state", target)
    assert_one_error(result, f"{target} is {kind}, not a file: give the path of a file to write")
    after = os.lstat(target)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)


def test_every_writer_refuses_a_fifo(tmp_path, corpus, tiny_run):
    from aftgen import curves

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("KING: fair")
    refused = f"{fifo} is a FIFO, not a file"
    assert_one_error(invoke("prime", prompt, "--model", tiny_run, "--out", fifo), refused)
    assert_one_error(
        invoke("train", corpus, "--out", fifo, "--preset", "tiny", "--threads", "1"), "a FIFO, not a folder"
    )
    if curves.available():
        assert_one_error(invoke("plot", tiny_run, "--out", fifo), refused)
    assert fifo.exists() and not fifo.is_file()


# --- Inputs: FIFOs and devices, crafted state files, weights too large to compute with --------------


def _fifo(folder: Path) -> tuple[Path, str]:
    os.mkfifo(folder / "fifo.txt")
    return folder / "fifo.txt", "a FIFO"


def _zero(folder: Path) -> tuple[Path, str]:
    return Path("/dev/zero"), "a device"


@pytest.mark.parametrize("make", [_fifo, _zero], ids=["fifo", "dev-zero"])
def test_inputs_that_are_not_files_are_refused_at_once(tmp_path, tiny_run, make, no_hang):
    source, kind = make(tmp_path)
    refused = f"{source}(: text file)? is {kind}, not a (regular )?file"
    model = ["--model", tiny_run, "--device", DEVICE]
    assert_one_error(invoke("eval", source, *model), refused)
    assert_one_error(invoke("sample", "--prompt-file", source, *model), refused)
    assert_one_error(invoke("prime", source, "--out", tmp_path / "s.safetensors", *model), refused)
    assert_one_error(invoke("sample", "--load-state", source, *model), refused)
    assert_one_error(invoke("train", source, "--out", tmp_path / "run", "--preset", "tiny", "--threads", "1"), refused)


def test_fifos_and_devices_in_a_corpus_folder_are_left_out(tmp_path, no_hang):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "plays.txt").write_text(make_corpus(20_000))
    os.mkfifo(folder / "fifo.txt")
    (folder / "zero.txt").symlink_to("/dev/zero")
    result = invoke("prepare", folder, "--vocab-size", 300)
    assert result.exit_code == 0, result.output
    assert "1 document," in result.stderr


INTEGER_CASES = [
    (["train", "--seed", str(1 << 64)], r"--seed must be in \[0, 9223372036854775807\]"),
    (["train", "--batch-size", str(1 << 64)], "--batch-size must be at most 65536"),
    (["prepare", "--vocab-size", str(1 << 64)], "--vocab-size must be at most 1048576"),
    (["prepare", "--workers", str(1 << 64)], "--workers must be between 1 and 1024"),
    (["prepare", "--workers", "0"], "--workers must be between 1 and 1024"),
]


@pytest.mark.parametrize("args,message", INTEGER_CASES, ids=[" ".join(c[0][:2]) for c in INTEGER_CASES])
def test_integers_out_of_range_are_refused_before_any_work(tmp_path, corpus, args, message):
    command, *option = args
    out = ["--out", tmp_path / "run", "--threads", "1"] if command == "train" else []
    assert_one_error(invoke(command, corpus, *out, *option), message)
    assert not (tmp_path / "run").exists()


def _positions(tensors: dict, value: int) -> None:
    for name, tensor in tensors.items():
        if name.endswith(".position"):
            tensor.fill_(value)


STATE_CASES = {
    "recent beyond the vocabulary": (lambda t: t["recent"].fill_(10**6), "recent tokens outside the vocabulary"),
    "recent negative": (lambda t: t["recent"].fill_(-7), "recent tokens outside the vocabulary"),
    "finite 3e38 values": (
        lambda t: [v.fill_(3e38) for v in t.values() if v.is_floating_point()],
        "scores from this state are NaN or infinite: the state file is damaged",
    ),
    "negative positions": (lambda t: _positions(t, -5), r"positions \[-5\] do not fit it"),
    "layers at different positions": (lambda t: t["layer0.position"].add_(1), r"positions \[\d+, \d+\] do not fit"),
}


def _rewrite_state(path: Path, change) -> None:
    """The state file at `path` with its tensors changed in place by `change`, its metadata kept."""
    from safetensors import safe_open

    with safe_open(path, "pt") as opened:
        metadata = opened.metadata()
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata=metadata)


@pytest.mark.parametrize("case", STATE_CASES)
def test_crafted_state_files_are_one_error(tmp_path, tiny_run, case):
    change, message = STATE_CASES[case]
    state, model = tmp_path / "s.safetensors", ["--model", tiny_run, "--device", DEVICE]
    assert invoke("sample", *model, "-p", "KING:", "-n", "3", "--save-state", state).exit_code == 0
    _rewrite_state(state, change)
    assert_one_error(invoke("sample", *model, "-n", "3", "--load-state", state), message)


def test_a_kv_cache_that_does_not_hold_its_position_is_refused(tmp_path, tiny_run):
    from aftgen.api import load
    from aftgen.generation.prompt import read_prompt
    from aftgen.model import AFTLM
    from aftgen.state import load_state, save_state

    _, tokenizer = load(tiny_run, DEVICE)
    torch.manual_seed(0)
    config = AFTConfig(vocab_size=tokenizer.vocab_size, n_layer=1, n_embd=32, n_head=2, mixer="attention")
    model, state = AFTLM(config).to(DEVICE).eval(), tmp_path / "s.safetensors"
    save_state(state, read_prompt(model, tokenizer, "KING:", seed=0), model, tokenizer)
    load_state(state, model, tokenizer)  # as saved: its cache holds every token it has read
    # Past the cache's end, the next step would grow the cache to hold that many tokens (2^40: terabytes).
    _rewrite_state(state, lambda tensors: _positions(tensors, tensors["layer0.keys"].shape[2] + 1))
    with pytest.raises(AftgenError, match="do not fit it"):
        load_state(state, model, tokenizer)


def test_weights_too_large_to_compute_with_are_one_error(tmp_path, tiny_run, corpus):
    """Finite weights (all 1e30) pass the loader's NaN check; the scores and losses they give do not."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_run, folder)
    retensor(lambda tensors: {name: torch.full_like(t, 1e30) for name, t in tensors.items()})(folder)
    model = ["--model", folder, "--device", DEVICE]
    assert_one_error(invoke("eval", corpus, *model), "loss is NaN or infinite by token .*: its weights are damaged")
    assert_one_error(invoke("sample", *model, "-p", "KING:", "-n", "4"), "NaN or infinite.*damaged")
