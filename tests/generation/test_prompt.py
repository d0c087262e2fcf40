"""Reading a prompt: in pieces fixed from its own start, so a seeded request gives the same bits alone, beside
another prompt being read, after a prefix cache's hit and in `aftgen sample` (issue 47); a prompt of any length
(`aftgen prime`, `sample --prompt-file`) in bounded memory, into the context the whole text gives; and an output
path that cannot be written is refused before any work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, make_corpus
from typer.testing import CliRunner

from aftgen.api import load
from aftgen.cli import app
from aftgen.corpus import sources
from aftgen.device import resolve
from aftgen.generation import prompt as prompt_module
from aftgen.generation.context import Context
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.prompt import PromptReader, opening, read_prompt
from aftgen.generation.scores import token_scores
from aftgen.generation.stream import TextStream
from aftgen.serve.engine import Engine
from aftgen.serve.options import ServeOptions
from aftgen.serve.work import Done, Started, Text, Work
from aftgen.state import load_state
from aftgen.tokenizer import Tokenizer

SEEDED = dict(seed=7, temperature=0.8, max_new_tokens=8)


@pytest.fixture(scope="module")
def text() -> str:
    """Play-like text of a few hundred tokens, other than the corpus the model read."""
    return make_corpus(3000, seed=5)


def served(tiny, prompts: list[list[int]], **options) -> list[tuple[int, str, list]]:
    """Each prompt's (cached tokens, text, score records) from one engine, the prompts submitted in turn, each
    once the one before has started generating (all at once where `together`)."""
    model, tokenizer = tiny
    together = options.pop("together", False)
    engine = Engine(model, tokenizer, ServeOptions(batch_invariant=True, **options), resolve(DEVICE, "fp32"))
    events: list = []
    engine.publish = events.extend
    tickets = []
    for ids in prompts:
        tickets.append(engine.submit(Work(ids, SamplingOptions(**SEEDED), logprobs=3)))
        while not together and not any(owner is tickets[-1] and isinstance(e, Started) for owner, e in events):
            engine.turn()
    while sum(isinstance(event, Done) for _, event in events) < len(tickets):
        engine.turn()

    def of(ticket, kind) -> list:
        return [event for owner, event in events if owner is ticket and isinstance(event, kind)]

    return [
        (
            of(t, Started)[0].cached_tokens,
            "".join(e.text for e in of(t, Text)),
            [s for e in of(t, Text) for s in e.scores],
        )
        for t in tickets
    ]


@pytest.mark.parametrize("chunk", [256, 16])
def test_a_prompt_reads_the_same_alone_and_behind_another_being_read(tiny, text, chunk):
    """The prompt ahead (249 tokens and BOS) leaves 6 tokens of a turn's 256 (10 of the last 16): the prompt
    behind it is still read in its own pieces, its first one past the turn's budget."""
    ids = tiny[1].encode(text)
    ahead, mine = ids[:249], ids[300:500]
    alone = served(tiny, [mine], prompt_chunk=chunk, cache_mb=0)[0]
    behind = served(tiny, [ahead, mine], prompt_chunk=chunk, cache_mb=0, together=True)[1]
    assert behind == alone


@pytest.mark.parametrize("earlier", [120, 400], ids=["within-a-piece", "past-a-piece"])
def test_a_prefix_cache_hit_leaves_the_rest_to_be_read_in_its_own_pieces(tiny, text, earlier):
    """A prompt that starts with an earlier one goes on from where that one's last piece starts (none: from the
    start), never from its end, and reads what it reads alone with no cache; the same prompt again starts from
    its end."""
    ids = tiny[1].encode(text)[:600]
    alone = served(tiny, [ids], cache_mb=0)[0]
    _, after_it, again = served(tiny, [ids[:earlier], ids, ids], cache_mb=16)
    assert after_it == ((earlier + 1) // 256 * 256, *alone[1:])  # the earlier one's BOS and its tokens
    assert again == (len(ids) + 1, *alone[1:])


def sampled(tiny, prompt: str) -> tuple[str, list]:
    """`aftgen sample`'s text for `prompt` (read_prompt, then its step alone), and each token's (id, score record)."""
    model, tokenizer = tiny
    context = read_prompt(model, tokenizer, prompt, seed=SEEDED["seed"])
    stream = TextStream(tokenizer, context, SamplingOptions(**SEEDED))
    pieces, scores = [stream.begin()], []
    with torch.inference_mode():
        while not stream.done:
            token = stream.next_token()
            scores += token_scores(context.logits, token, 3)
            pieces.append(stream.accept(int(token), model.step(token, context.state)[0]))
    return "".join(pieces) + stream.end(), scores


def test_a_long_prompt_reads_as_aftgen_sample_reads_it(tiny, text):
    """Past one turn's piece (831 tokens: a server read them 256 a turn, `aftgen sample` in one pass of 1,024 at
    most): the text and every token's scores are `aftgen sample`'s."""
    prompt = text[:2000]
    assert len(tiny[1].encode(prompt)) > 3 * 256
    _, served_text, scores = served(tiny, [tiny[1].encode(prompt)], cache_mb=0)[0]
    assert (served_text, [score[1:] for score in scores]) == sampled(tiny, prompt)


runner = CliRunner()


TEXT_CHUNK, PIECE, BLOCK_BYTES = 64, 16, 100  # tiny, so that a short text crosses many of each


# Runs of spaces and a character of several bytes, whose tokens a careless cut would change.
TEXT = make_corpus(3000, seed=5).replace("king", "king  ").replace("night", "n\u65e5ght")


@pytest.fixture
def small_pieces(monkeypatch) -> list[int]:
    """Tiny text chunks, prompt pieces and file blocks; the lengths of the texts encoded (appended as they are)."""
    monkeypatch.setattr(prompt_module, "TEXT_CHUNK", TEXT_CHUNK)
    monkeypatch.setattr(prompt_module, "PROMPT_CHUNK", PIECE)
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

    monkeypatch.setattr(prompt_module, "PromptReader", Counted)
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
    monkeypatch.setattr(prompt_module, "TEXT_CHUNK", len(TEXT))  # the whole text encoded at once
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
    monkeypatch.setattr(prompt_module, "TEXT_CHUNK", len(TEXT))  # the option's text encoded at once
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


def test_prime_reads_a_long_text_in_chunks(tiny, tiny_run, corpus, tmp_path, monkeypatch):
    model, tokenizer = tiny
    style = tmp_path / "style.safetensors"
    result = runner.invoke(app, ["prime", "--model", str(tiny_run), "--device", DEVICE, str(corpus), "-o", str(style)])
    assert result.exit_code == 0, result.stderr
    primed = load_state(style, model, tokenizer)
    assert int(primed.state[0]["position"]) == 1 + len(tokenizer.encode(corpus.read_text()))
    # Chunk boundaries do not change what was read.
    monkeypatch.setattr(prompt_module, "PROMPT_CHUNK", 37)
    small_chunks = read_prompt(model, tokenizer, corpus.read_text()[:3000], seed=0)
    monkeypatch.undo()
    one_pass = read_prompt(model, tokenizer, corpus.read_text()[:3000], seed=0)
    assert (small_chunks.logits - one_pass.logits).abs().max() < 1e-4
    sampled = runner.invoke(
        app,
        ["sample", "--model", str(tiny_run), "--device", DEVICE, "--load-state", str(style), "-n", "10", "--seed", "2"],
    )
    assert sampled.exit_code == 0 and sampled.stdout.strip()


def test_compiled_chunk_reader_reads_a_long_prompt_as_eager_does(tiny_run, monkeypatch):
    """prime --compile's reader: whole chunks through the compiled prefill (compiled whole: torch.compile with
    fullgraph, never the eager fallback), the rest eager, the same state."""
    from aftgen.compiled.functions import compile_prefill

    monkeypatch.setattr(prompt_module, "PROMPT_CHUNK", 64)
    model, tokenizer = load(str(tiny_run), device=DEVICE)
    text = "KING: good night sweet lady, the crown is fair. " * 30  # several whole chunks and a remainder
    assert len(tokenizer.encode(text)) > 3 * 64
    reader, note = compile_prefill(model, 64)
    assert reader != model.prefill and note.startswith("compiled"), note  # bound methods: equal, never the same
    eager = read_prompt(model, tokenizer, text, seed=0)
    compiled = read_prompt(model, tokenizer, text, seed=0, prefill=reader)
    torch.testing.assert_close(compiled.logits, eager.logits, atol=1e-4, rtol=1e-4)
    for fast, slow in zip(compiled.state, eager.state, strict=True):
        assert fast.keys() == slow.keys()
        for name in fast:
            torch.testing.assert_close(fast[name], slow[name], atol=1e-4, rtol=1e-4, msg=name)


def test_chunk_reader_falls_back_to_eager_where_compiling_fails(tiny_run, monkeypatch):
    from aftgen.compiled.functions import compile_prefill

    def no_compiler(function, **options):
        def fails(*args, **kwargs):
            raise RuntimeError("no C++ compiler found")

        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    model, _ = load(str(tiny_run), device=DEVICE)
    reader, note = compile_prefill(model, 16)
    assert reader == model.prefill and note.startswith("eager (torch.compile failed: RuntimeError")
