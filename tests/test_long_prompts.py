"""A prompt of any length (`aftgen prime`, `sample --prompt-file`) read in bounded memory: its text encoded a chunk at
a time and its ids read a whole number of pieces at a time, into the context the whole text read at once gives; and
an output path that cannot be written is refused before any work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, make_corpus
from typer.testing import CliRunner

from aftgen import sampling
from aftgen.api import load
from aftgen.cli import app
from aftgen.corpus import sources
from aftgen.sampling import Context, PromptReader, opening, read_prompt
from aftgen.state import load_state
from aftgen.tokenizer import Tokenizer

runner = CliRunner()
TEXT_CHUNK, PIECE, BLOCK_BYTES = 64, 16, 100  # tiny, so that a short text crosses many of each
# Runs of spaces and a character of several bytes, whose tokens a careless cut would change.
TEXT = make_corpus(3000, seed=5).replace("king", "king  ").replace("night", "n\u65e5ght")


@pytest.fixture(scope="module")
def tiny(tiny_run):
    return load(tiny_run, device=DEVICE)


@pytest.fixture
def small_pieces(monkeypatch) -> list[int]:
    """Tiny text chunks, prompt pieces and file blocks; the lengths of the texts encoded (appended as they are)."""
    monkeypatch.setattr(sampling, "TEXT_CHUNK", TEXT_CHUNK)
    monkeypatch.setattr(sampling, "PROMPT_CHUNK", PIECE)
    monkeypatch.setattr(sources, "BLOCK_BYTES", BLOCK_BYTES)
    encoded, encode = [], Tokenizer.encode

    def counted(tokenizer: Tokenizer, text: str) -> list[int]:
        encoded.append(len(text))
        return encode(tokenizer, text)

    monkeypatch.setattr(Tokenizer, "encode", counted)
    return encoded


def read_whole(model, tokenizer: Tokenizer, text: str, seed: int, piece: int) -> Context:
    """The text's ids all encoded and read at once, in pieces of `piece` ids (before blocks, read_prompt's way)."""
    with torch.inference_mode():
        reader = PromptReader(model, opening(tokenizer, tokenizer.encode(text), None), None, seed, piece=piece)
        reader.read()
        return reader.finish()


def assert_same_context(got: Context, expected: Context) -> None:
    for have, want in zip(got.state, expected.state, strict=True):
        assert have.keys() == want.keys() and all(torch.equal(have[name], want[name]) for name in have)
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.history(), expected.history())
    assert torch.equal(got.generator.get_state(), expected.generator.get_state()) and got.pending == expected.pending


@pytest.mark.parametrize("given", ["text", "blocks"])
def test_a_long_prompt_is_encoded_and_read_in_bounded_pieces_into_the_whole_texts_context(
    tiny, small_pieces, monkeypatch, given
):
    model, tokenizer = tiny
    expected = read_whole(model, tokenizer, TEXT, seed=3, piece=PIECE)
    small_pieces.clear()
    ids_read: list[int] = []

    class Counted(PromptReader):
        def __init__(self, model, ids, *args, **kwargs):
            ids_read.append(len(ids))
            super().__init__(model, ids, *args, **kwargs)

    monkeypatch.setattr(sampling, "PromptReader", Counted)
    # Blocks cut anywhere, inside words and runs of spaces alike, as a file's blocks are.
    prompt = TEXT if given == "text" else [TEXT[at : at + 50] for at in range(0, len(TEXT), 50)]
    assert_same_context(read_prompt(model, tokenizer, prompt, seed=3), expected)
    assert 0 < max(small_pieces) <= TEXT_CHUNK and sum(small_pieces) == len(TEXT)
    assert max(ids_read) < TEXT_CHUNK + PIECE and sum(ids_read) == int(expected.state[0]["position"])


def test_prime_reads_a_file_in_bounded_pieces_into_the_whole_texts_state(
    tiny, tiny_run, small_pieces, tmp_path, monkeypatch
):
    model, tokenizer = tiny
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    common = ["prime", "--model", str(tiny_run), "--device", DEVICE, str(tmp_path / "text.txt"), "--seed", "3", "-o"]
    primed = runner.invoke(app, [*common, str(tmp_path / "primed.safetensors")])
    assert primed.exit_code == 0, primed.output
    assert 0 < max(small_pieces) <= TEXT_CHUNK
    monkeypatch.setattr(sampling, "TEXT_CHUNK", len(TEXT))  # the whole text encoded at once
    whole = runner.invoke(app, [*common, str(tmp_path / "whole.safetensors")])
    assert whole.exit_code == 0, whole.output
    assert max(small_pieces) == len(TEXT)
    assert_same_context(
        load_state(tmp_path / "primed.safetensors", model, tokenizer),
        load_state(tmp_path / "whole.safetensors", model, tokenizer),
    )


def test_a_prompt_file_is_read_and_echoed_in_bounded_pieces_as_the_prompt_option_is(
    tiny_run, small_pieces, tmp_path, monkeypatch
):
    (tmp_path / "prompt.txt").write_text(TEXT, encoding="utf-8")
    common = ["sample", "--model", str(tiny_run), "--device", DEVICE, "-n", "20", "--seed", "4", "--num-samples", "2"]
    from_file = runner.invoke(app, [*common, "--prompt-file", str(tmp_path / "prompt.txt")])
    assert from_file.exit_code == 0, from_file.output
    assert 0 < max(small_pieces) <= TEXT_CHUNK
    monkeypatch.setattr(sampling, "TEXT_CHUNK", len(TEXT))  # the option's text encoded at once
    given = runner.invoke(app, [*common, "--prompt", TEXT])
    assert given.exit_code == 0, given.output
    assert max(small_pieces) == len(TEXT)
    samples = from_file.stdout.split("\n\n---\n\n")
    assert len(samples) == 2 and all(sample.startswith(TEXT) for sample in samples)  # each echoes the prompt
    assert from_file.stdout == given.stdout


def _folder(path: Path) -> str:
    path.mkdir()
    return "a folder"


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return "a FIFO"


@pytest.mark.parametrize("make", [_folder, _fifo], ids=["folder", "fifo"])
@pytest.mark.parametrize(
    "command",
    [["sample", "-p", "KING:", "--save-state"], ["chat", "--save-state"], ["prime", "{text}", "--out"]],
    ids=["sample", "chat", "prime"],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, make, command):
    (tmp_path / "text.txt").write_text("KING: fair")
    target = tmp_path / "target"
    kind = make(target)
    args = [part.format(text=tmp_path / "text.txt") for part in command]
    # The model does not exist: the destination's error coming first shows that nothing was loaded or read.
    result = runner.invoke(app, [*args, str(target), "--model", str(tmp_path / "no-model")], input="KING: hail\n")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: {target} is {kind}, not a file: give the path of a file to write"
    ]
    assert result.stdout == ""
