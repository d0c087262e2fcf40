"""Issue 47, item 9: what once ended in an internal error or went on without a word is one clear error, or
behaves as the user meant."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import DEVICE, make_corpus, train_tiny
from typer.testing import CliRunner

from aftgen.cli import app
from aftgen.corpus import CorpusOptions, prepare_corpus
from aftgen.errors import AftgenError
from aftgen.record import TRAINING_INFO

runner = CliRunner()


@pytest.mark.parametrize(
    "option, value", [("--max-time", "1e308"), ("--max-time", "1e306h"), ("--max-steps", "9" * 400)]
)
def test_a_budget_beyond_any_run_is_refused_at_its_option(corpus, option, value):
    result = runner.invoke(app, ["train", str(corpus), "--out", "unused", option, value, "--device", DEVICE])
    assert result.exit_code == 2, result.output
    assert f"error: {option} must be at most" in result.output


@pytest.fixture
def short_run(tmp_path, corpus, tiny_run):
    """Two steps into a run, clipped at 0.5 (an option with a default of its own)."""
    return train_tiny(corpus, tmp_path / "run", max_steps=2, grad_clip=0.5)


def test_a_resume_refuses_another_text_and_another_split(tmp_path, corpus, short_run):
    other = tmp_path / "other.txt"
    other.write_text(make_corpus(40_000, seed=5))
    with pytest.raises(AftgenError, match=rf"{other} is not the text the run in .* was trained on \({corpus}\)"):
        train_tiny(other, short_run, resume=True, max_steps=4)
    with pytest.raises(AftgenError, match="--held-out 5000 contradicts the run in"):  # other held-out scores
        train_tiny(corpus, short_run, resume=True, max_steps=4, held_out=5_000)


def test_a_resume_refuses_options_that_contradict_the_run_and_keeps_the_ones_left_out(corpus, short_run):
    with pytest.raises(AftgenError) as refused:
        train_tiny(corpus, short_run, resume=True, max_steps=4, preset="small", vocab_size=500, lr=0.1)
    message = str(refused.value)
    assert message.startswith("--preset small, --lr 0.1, --vocab-size 500 contradict the run in")
    assert "(preset tiny, lr 0.003, vocab_size 400)" in message
    train_tiny(corpus, short_run, resume=True, max_steps=4, grad_clip=1.0)  # --grad-clip left out: the run's
    info = json.loads((short_run / TRAINING_INFO).read_text())
    assert info["step"] == 4 and info["options"]["grad_clip"] == 0.5


def test_a_one_character_corpus_is_too_small_for_a_tokenizer(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("a")
    with pytest.raises(AftgenError, match="too small to train a tokenizer: 1 character, all of it held out"):
        prepare_corpus([path], CorpusOptions(vocab_size=300), log=lambda _: None)


def test_a_run_folder_inside_the_corpus_folder_is_no_part_of_the_corpus(tmp_path, corpus, tiny_run):
    folder = tmp_path / "texts"
    folder.mkdir()
    shutil.copy(corpus, folder / "plays")
    out = train_tiny(folder, folder / "run", glob="*", max_steps=2)
    train_tiny(folder, out, glob="*", max_steps=4, resume=True)  # its model, card and curves are not read
    assert json.loads((out / TRAINING_INFO).read_text())["step"] == 4
    with pytest.raises(AftgenError, match="this corpus folder is the run folder .* or inside it"):
        train_tiny(folder, folder, glob="*", max_steps=2)


def test_a_reader_that_leaves_before_the_help_ends_is_exit_0_and_quiet():
    """`aftgen --help | head -1`: the pipe's reader gone before aftgen writes."""
    process = subprocess.Popen(
        [sys.executable, "-m", "aftgen", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()
    _, errors = process.communicate(timeout=60)
    assert process.returncode == 0 and errors == b""


def test_other_processes_see_a_command_by_its_name(tiny_run, monkeypatch):
    from aftgen import cores

    named = []
    monkeypatch.setattr(cores, "set_up", lambda command, *rest: named.append(command) or 1)
    result = runner.invoke(app, ["sample", "--model", str(tiny_run), "--device", DEVICE, "-n", "1", "-p", "KING:"])
    assert result.exit_code == 0, result.output
    assert named == ["sample"]
