"""The tokenizer over HTTP, vLLM's routes: POST /tokenize, POST /detokenize, GET /tokenizer_info, against one
real `aftgen serve` of the tiny model."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import AUTH, LIMITS, assert_openai_error, post, running

from aftgen.serve.conversation import chat_ids
from aftgen.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is there?"}]


@pytest.fixture(scope="module")
def url(tiny_run) -> Iterator[str]:
    with running(tiny_run, max_body_bytes=1 << 17) as base:  # room for a list of too many token ids
        yield base


@pytest.fixture(scope="module")
def tokenizer(tiny_run) -> Tokenizer:
    return Tokenizer.load(tiny_run / "tokenizer.model")


def tokenize(url: str, **body) -> dict:
    response = post(url, "/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def detokenize(url: str, tokens: list[int]) -> str:
    response = post(url, "/detokenize", json={"tokens": tokens})
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(["<s>a</s>", "\u2581 \ue000s"]))
def test_text_to_ids_to_text_is_the_text_and_ids_are_the_tokenizers(url, tokenizer, text):
    reply = tokenize(url, prompt=text, add_special_tokens=False)
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == LIMITS["max_prompt_tokens"]
    assert detokenize(url, reply["tokens"]) == text
    if "<s>" not in text and "</s>" not in text:  # the names of the control tokens aside, what the model reads
        assert reply["tokens"] == tokenizer.encode(text)


def test_special_tokens_bos_first_messages_as_the_chat_route_reads_them(url, tokenizer):
    info = httpx.get(f"{url}/tokenizer_info", headers=AUTH, timeout=10).json()
    assert info["vocab_size"] == tokenizer.vocab_size and info["bos_token_id"] == tokenizer.bos_id
    for name in ("bos", "eos"):  # what lm-eval's remote tokenizer does to find their ids
        ids = tokenize(url, prompt=info[f"{name}_token"], add_special_tokens=False)["tokens"]
        assert ids == [info[f"{name}_token_id"]]
    assert tokenize(url, prompt="KING")["tokens"] == [tokenizer.bos_id, *tokenizer.encode("KING")]
    pieces = tokenize(url, prompt="KING", return_token_strs=True)["token_strs"]
    assert pieces == [tokenizer.sp.id_to_piece(i) for i in [tokenizer.bos_id, *tokenizer.encode("KING")]]

    counted = tokenize(url, messages=MESSAGES)
    pairs = [(m["role"], m["content"]) for m in MESSAGES]
    assert counted["tokens"] == [tokenizer.bos_id, *chat_ids(tokenizer, pairs)]
    chat = post(url, "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 0}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"]
    under_v1 = post(url, "/v1/tokenize", json={"prompt": "KING"}).json()
    assert under_v1 == tokenize(url, prompt="KING")


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/tokenize"])
def test_the_tokenizer_routes_need_the_key(url, path):
    body = {"prompt": "KING", "tokens": [1]}
    assert_openai_error(post(url, path, key=None, json=body), 401)
    assert_openai_error(post(url, path, key="wrong", json=body), 401)
    response = httpx.get(f"{url}/tokenizer_info", timeout=10)
    assert_openai_error(response, 401)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/detokenize", {"tokens": [1, 400]}, "tokens[1]"),  # the tiny model's vocabulary is 400
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {"tokens": [1.5]}, "tokens[0]"),
        ("/detokenize", {"tokens": [True]}, "tokens[0]"),
        ("/detokenize", {"tokens": ["3"]}, "tokens[0]"),
        ("/detokenize", {"tokens": "3"}, "tokens"),
        ("/detokenize", {"tokens": [0] * (LIMITS["max_prompt_tokens"] + LIMITS["max_tokens"] + 1)}, "tokens"),
        ("/detokenize", {}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "king"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
    ],
)
def test_bad_input_gets_400_naming_the_field(url, path, body, param):
    assert_openai_error(post(url, path, content=json.dumps(body)), 400, param)  # json.dumps: it can spell \ud800


def test_a_body_that_is_not_json_or_another_model_is_refused(url):
    for path, body in [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})]:
        assert_openai_error(post(url, path, content=b"{not json"), 400)
        assert_openai_error(post(url, path, json=body | {"model": "gpt-4"}), 404, "model")
