"""Where a request's prompt starts reading (aftgen.serve.prompts): after the longest piece of an earlier prompt
that the prefix cache kept, reaching the state a read from the start reaches; from a session's context, one turn
at a time; and an echo's text with each of its tokens' scores where that token's text starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aftgen.api import load
from aftgen.generation.controls import SamplingOptions
from aftgen.serve.cache import PrefixCache
from aftgen.serve.options import ServeOptions
from aftgen.serve.prompts import Prompts
from aftgen.serve.rows import Reader
from aftgen.serve.sessions import SUFFIX, SessionStore
from aftgen.serve.work import Failed, Ticket, Work

PIECE = 4  # --prompt-chunk: a kept prompt's pieces end at multiples of it


@pytest.fixture(scope="module")
def tiny(tiny_run):
    return load(tiny_run)


def served(tiny, cache_mb: float = 16, sessions_dir: Path | None = None) -> Prompts:
    model, tokenizer = tiny
    cache = PrefixCache(cache_mb, PIECE) if cache_mb else None
    sessions = SessionStore(model, tokenizer, sessions_dir, limit=4, max_files=4)
    return Prompts(model, tokenizer, ServeOptions(prompt_chunk=PIECE, cache_mb=cache_mb), cache, sessions, set())


def started(prompts: Prompts, ids: list[int], **fields) -> Reader | Failed:
    return prompts.start(Ticket(Work(ids, SamplingOptions(seed=1), **fields), 0.0))


def read(prompts: Prompts, ids: list[int], **fields) -> Reader:
    reader = started(prompts, ids, **fields)
    reader.prompt.read()
    return reader


@torch.inference_mode()
def test_a_prompt_goes_on_from_the_longest_piece_of_an_earlier_one_that_the_cache_kept(tiny):
    """The same prompt again reads nothing; one that extends it reads on from where its last, shorter piece began,
    and both reach the logits that a server without a cache reaches."""
    tokenizer = tiny[1]
    first = tokenizer.encode("KING: speak, my lord")
    read_first = len(first) + 1  # BOS first
    assert read_first % PIECE and read_first > PIECE  # its last piece is shorter, so it starts at a piece's end
    prompts = served(tiny)
    kept = read(prompts, first)
    prompts.keep(kept.prompt, kept.cached)
    longer = first + tokenizer.encode(" and what then?")
    for ids, cached in ((first, read_first), (longer, read_first // PIECE * PIECE)):
        reader, alone = read(prompts, ids), read(served(tiny, cache_mb=0), ids)
        assert reader.cached == cached
        assert torch.equal(reader.prompt.context.logits, alone.prompt.context.logits)


@torch.inference_mode()
def test_a_session_is_continued_one_turn_at_a_time_and_a_damaged_one_not_at_all(tiny, tmp_path):
    tokenizer = tiny[1]
    prompts = served(tiny, cache_mb=0, sessions_dir=tmp_path)
    turn = read(prompts, tokenizer.encode("KING:"), session="s")
    assert turn.prompt.ids[0] == tokenizer.bos_id and prompts.busy == {"s"}  # a new session reads BOS first
    refused = started(prompts, tokenizer.encode(" and"), session="s")
    assert isinstance(refused, Failed) and (refused.status, refused.code) == (409, "session_busy")
    prompts.sessions.put("s", turn.prompt.finish())
    prompts.busy.discard("s")
    then = started(prompts, tokenizer.encode(" and"), session="s")
    assert then.prompt.ids == tokenizer.encode(" and") and then.prompt.context.logits.abs().sum() > 0
    (tmp_path / f"bad{SUFFIX}").write_bytes(b"not a state")
    damaged = started(prompts, tokenizer.encode(" and"), session="bad")
    assert isinstance(damaged, Failed) and damaged.status == 400 and "'bad'" in damaged.message
    assert prompts.busy == {"s"}


@torch.inference_mode()
def test_an_echo_gives_the_prompts_text_and_each_tokens_score_where_its_text_starts(tiny):
    tokenizer = tiny[1]
    ids = tokenizer.encode("KING: speak, my lord")
    prompts = served(tiny)
    echo = prompts.echo(read(prompts, ids, logprobs=2, echo=True))
    assert echo.text == tokenizer.decode(ids)
    starts = [score[0] for score in echo.scores]
    assert [score[1] for score in echo.scores] == ids  # the client's tokens: not the BOS read before them
    assert starts[0] == 0 and starts == sorted(starts) and starts[-1] < len(echo.text)
    assert prompts.echo(read(prompts, ids, echo=True)).scores is None
