"""The same request, the same numbers, while its prompt is read (issue 47): a prompt is read in pieces fixed from its
own start, so a seeded request's text and every token's score are the same bits alone, while another prompt is
read beside it, after a prefix cache's hit, and as `aftgen sample` reads it. Driven turn by turn, each row
stepped apart (--batch-invariant's eager step), so that only the reading of the prompt can differ."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, make_corpus

from aftgen.api import load
from aftgen.device import resolve
from aftgen.sampling import SamplingOptions, TextStream, read_prompt, token_scores
from aftgen.serve.engine import Engine
from aftgen.serve.options import ServeOptions
from aftgen.serve.work import Done, Started, Text, Work

SEEDED = dict(seed=7, temperature=0.8, max_new_tokens=8)


@pytest.fixture(scope="module")
def tiny(tiny_run):
    return load(tiny_run, device=DEVICE)


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
