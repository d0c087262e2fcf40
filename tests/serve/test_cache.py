"""aftgen.serve.cache: a prompt that extends one read before reads only its new tokens."""

from __future__ import annotations

import pytest
import torch
from serving import client, running

from aftgen.api import load
from aftgen.serve.cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def test_second_chat_turn_reads_only_its_new_tokens_and_its_historys_last_piece(tiny_run):
    """The cache holds the conversation where its last piece starts (a prompt is read in pieces from its start):
    the second turn reads that piece and its new message, and gives what a server with no cache gives."""
    api, tokenizer = client, load(tiny_run)[1]
    history = [{"role": "user", "content": "KING: speak, my lord"}]
    with running(tiny_run, in_process=True, prompt_chunk=16) as url:
        first = api(url).chat.completions.create(messages=history, model=tiny_run.name, max_tokens=30, seed=2)
        history += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "QUEEN: and what then?"},
        ]
        second = api(url).chat.completions.create(messages=history, model=tiny_run.name, max_tokens=30, seed=5)
    read_before = second.usage.prompt_tokens - len(tokenizer.encode("QUEEN: and what then?\n"))
    assert second.usage.prompt_tokens_details.cached_tokens == read_before // 16 * 16 > 0
    with running(tiny_run, in_process=True, prompt_chunk=16, cache_mb=0) as fresh_url:
        fresh = api(fresh_url).chat.completions.create(messages=history, model=tiny_run.name, max_tokens=30, seed=5)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.usage.prompt_tokens == second.usage.prompt_tokens
    assert fresh.choices[0].message.content == second.choices[0].message.content


def marked(value: float) -> list[dict[str, torch.Tensor]]:
    """A one-layer state of 4,000 bytes whose every number is `value`."""
    return [{"window": torch.full((1000,), value)}]


def test_a_hit_is_the_longest_prefix_that_ends_a_piece_a_copy_and_the_least_recent_goes_first():
    cache, logits = PrefixCache(megabytes=0.009, piece=4), torch.zeros(1, 10)  # room for two states
    cache.put([1, 2, 3, 4], marked(1.0), logits)
    cache.put([1, 2, 3, 4, 5, 6], marked(2.0), logits)
    longer = cache.lookup([1, 2, 3, 4, 5, 6, 7, 8])  # 6 tokens end no piece of 8: the rest would be read unevenly
    assert longer.tokens == 4 and longer.state[0]["window"][0] == 1.0
    assert cache.lookup([1, 2, 3, 4, 5, 6]).tokens == 6 and cache.lookup([1, 2, 3]) is None
    longer.state[0]["window"].fill_(9.0)
    assert cache.lookup([1, 2, 3, 4]).state[0]["window"][0] == 1.0  # the cache's own state is untouched
    cache.lookup([1, 2, 3, 4])  # now the most recently used
    cache.put([7, 7, 7, 7], marked(3.0), logits)
    assert len(cache) == 2 and cache.lookup([1, 2, 3, 4, 5, 6]).tokens == 4
