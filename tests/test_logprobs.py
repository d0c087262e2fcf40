"""Log-probabilities from `aftgen serve`: completions' `logprobs` and `echo`, chat's `logprobs` and `top_logprobs`,
streamed and not, in OpenAI's shapes (parsed by the official client), and echo's figures against `aftgen eval`'s."""

from __future__ import annotations

import ctypes
import json
import math
import time
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import DEVICE, make_corpus
from serving import assert_openai_error, client, post, running, server_options, serving

from aftgen.api import load
from aftgen.device import resolve
from aftgen.evaluate import evaluate_text
from aftgen.generation.controls import SamplingOptions
from aftgen.native import library
from aftgen.serve import engine as engine_module
from aftgen.serve.engine import Engine
from aftgen.serve.replies import FIGURE
from aftgen.serve.schema import APIError, parse_request
from aftgen.serve.work import Done, Work

HELD_OUT = make_corpus(1500, seed=48)  # text the tiny model never trained on; several prompt chunks long


@pytest.fixture(scope="module")
def url(tiny_run) -> Iterator[str]:
    with running(tiny_run, max_prompt_tokens=4096, max_body_bytes=1 << 16) as base:
        yield base


@pytest.fixture(scope="module")
def tokenizer(tiny_run):
    return load(tiny_run, DEVICE)[1]


def assert_alternatives_sorted_and_at_most(alternatives: list[float], most: int) -> None:
    assert 0 < len(alternatives) <= most and alternatives == sorted(alternatives, reverse=True)


def completion(url: str, **fields) -> dict:
    response = post(url, "/v1/completions", json={"prompt": "KING:", "temperature": 0} | fields)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_completions_logprobs_and_echo_through_the_openai_client(url, tiny_run):
    api = client(url)
    asked = dict(model=tiny_run.name, prompt="KING:", max_tokens=12, temperature=0, logprobs=3, echo=True)
    whole = api.completions.create(**asked).choices[0]
    assert whole.text.startswith("KING:")
    scores = whole.logprobs
    assert len(scores.tokens) == len(scores.token_logprobs) == len(scores.top_logprobs) == len(scores.text_offset)
    assert "".join(scores.tokens) == whole.text  # plain text: no byte-fallback piece in this model's reply
    assert all(whole.text[at:].startswith(token) for token, at in zip(scores.tokens, scores.text_offset, strict=True))
    assert None not in scores.token_logprobs  # the prompt's first token is scored after the BOS read before it
    for logprob, top in zip(scores.token_logprobs, scores.top_logprobs, strict=True):
        assert_alternatives_sorted_and_at_most(list(top.values()), 3)
        assert logprob <= max(top.values()) + 1e-6
    prompt_tokens = len([offset for offset in scores.text_offset if offset < len("KING:")])
    drawn = list(zip(scores.tokens, scores.token_logprobs, scores.top_logprobs, strict=True))[prompt_tokens:]
    for token, logprob, top in drawn:
        assert next(iter(top)) == token and top[token] == logprob  # greedy: each drawn token is the likeliest

    chunks = list(api.completions.create(**asked, stream=True))
    streamed = [chunk.choices[0].logprobs for chunk in chunks if chunk.choices[0].logprobs is not None]
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.text
    assert [token for part in streamed for token in part.tokens] == scores.tokens
    assert [offset for part in streamed for offset in part.text_offset] == scores.text_offset
    assert [value for part in streamed for value in part.token_logprobs] == pytest.approx(scores.token_logprobs)

    plain = api.completions.create(**asked | dict(logprobs=None, echo=False)).choices[0]
    assert plain.logprobs is None and whole.text == "KING:" + plain.text


def test_each_figure_is_the_engines_float32_in_at_most_9_digits(url):
    """Nine significant digits give a float32 back exactly; the 17 of its widened double only cost time to write."""
    fields = {"prompt": "KING:", "max_tokens": 8, "temperature": 1.0, "seed": 3, "echo": True, "logprobs": 5}
    figures = []
    for path, asked in (("/v1/completions", fields), ("/v1/chat/completions", CHAT_SCORED)):
        for stream in (False, True):
            response = post(url, path, json=asked | {"stream": stream})
            assert response.status_code == 200, response.text
            bodies = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
            figures += [figure for body in bodies for figure in written_figures(json.loads(body, parse_float=Figure))]
    assert len(figures) > 100
    for figure in figures:  # read as a float32 and written back to 9 digits, each is as it was
        assert figure == f"{np.float32(figure):.9g}"


CHAT_SCORED = {
    "messages": [{"role": "user", "content": "KING:"}], "max_tokens": 8, "temperature": 1.0, "seed": 3,
    "logprobs": True, "top_logprobs": 5,
}  # fmt: skip


class Figure(str):
    """A fraction as the JSON wrote it."""


def written_figures(value: object) -> list[Figure]:
    if isinstance(value, Figure):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [figure for item in items for figure in written_figures(item)]


def test_a_stop_strings_tokens_are_not_scored(url):
    sampled = dict(max_tokens=40, logprobs=0, temperature=1.0, seed=1)
    whole = completion(url, **sampled)
    stop = whole["text"][20:23]
    stopped = completion(url, **sampled, stop=[stop])
    assert stopped["text"] == whole["text"][: whole["text"].index(stop)] != ""
    scored = zip(whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"], strict=True)
    shown = [token for token, offset in scored if offset < len(stopped["text"])]
    assert stopped["logprobs"]["tokens"] == shown  # those whose text begins before the stop string
    assert stopped["logprobs"]["top_logprobs"][0] == {}  # logprobs: 0, the drawn token's score alone


def test_chat_logprobs_and_top_logprobs_through_the_openai_client(url, tiny_run):
    api = client(url)
    asked = dict(model=tiny_run.name, messages=[{"role": "user", "content": "KING:"}], max_tokens=12, temperature=0)
    whole = api.chat.completions.create(**asked, logprobs=True, top_logprobs=2).choices[0]
    content = whole.logprobs.content
    assert "".join(entry.token for entry in content) == whole.message.content
    for entry in content:
        assert bytes(entry.bytes) == entry.token.encode("utf-8")
        assert_alternatives_sorted_and_at_most([top.logprob for top in entry.top_logprobs], 2)
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)

    chunks = list(api.chat.completions.create(**asked, logprobs=True, top_logprobs=2, stream=True))
    streamed = [entry for chunk in chunks if chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [(entry.token, entry.bytes) for entry in streamed] == [(entry.token, entry.bytes) for entry in content]
    assert api.chat.completions.create(**asked).choices[0].logprobs is None


def test_echo_with_max_tokens_0_scores_a_text_as_aftgen_eval_does(url, tiny_run, tokenizer):
    choice = completion(url, prompt=HELD_OUT, max_tokens=0, echo=True, logprobs=1)
    assert choice["text"] == HELD_OUT and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]["token_logprobs"]
    evaluated = evaluate_text(load(tiny_run, DEVICE)[0], tokenizer, HELD_OUT)
    assert len(logprobs) == evaluated.tokens == len(tokenizer.encode(HELD_OUT)) > 2 * 256  # several chunks
    assert -math.fsum(logprobs) == pytest.approx(evaluated.nats_per_token * evaluated.tokens, rel=1e-6)


def test_a_prompt_of_token_ids_scores_as_its_text(url, tokenizer):
    text = HELD_OUT[:300]
    ids = tokenizer.encode(text)
    as_text = completion(url, prompt=text, max_tokens=5, echo=True, logprobs=2)
    for given in (ids, [ids]):  # lm-evaluation-harness sends a list holding one list of ids
        assert completion(url, prompt=given, max_tokens=5, echo=True, logprobs=2) == as_text
    with_bos = completion(url, prompt=[tokenizer.bos_id, *ids], max_tokens=5, echo=True, logprobs=2)["logprobs"]
    assert with_bos["token_logprobs"][0] is None and with_bos["top_logprobs"][0] is None  # nothing predicts it
    assert with_bos["token_logprobs"][1:] == as_text["logprobs"]["token_logprobs"]  # and no second BOS is read


def test_an_echos_scores_leave_the_engine_once_and_reach_every_choice(url, tiny_run, tokenizer):
    """n: 3 with echo and logprobs: the engine hands the prompt's scores on once, not once a choice (an echo of
    8,191 tokens with 20 alternatives each is megabytes), and every choice shows the same ones."""
    ids = tokenizer.encode(HELD_OUT[:200])
    engine = Engine(*load(tiny_run, DEVICE), server_options(tiny_run), resolve(DEVICE, "fp32"))
    events: list = []
    engine.publish = events.extend
    engine.submit(Work(ids, SamplingOptions(max_new_tokens=0), n=3, logprobs=2, echo=True))
    for _ in range(100):
        if any(isinstance(event, Done) for _, event in events):
            break
        engine.turn()
    assert sum(len(getattr(event, "scores", None) or ()) for _, event in events) == len(ids)
    fields = {"prompt": ids, "n": 3, "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 1.0, "seed": 5}
    choices = post(url, "/v1/completions", json=fields).json()["choices"]
    echoed = [{name: figures[: len(ids)] for name, figures in choice["logprobs"].items()} for choice in choices]
    assert len(choices) == 3 and len(echoed[0]["token_logprobs"]) == len(ids)
    assert echoed[1] == echoed[0] and echoed[2] == echoed[0]


def test_an_echo_whose_scores_pass_the_limit_gets_400(url, tiny_run, tokenizer):
    """n x prompt tokens x (1 + logprobs) past --max-echo-scores is a 400 naming `echo`, before any work; at the limit
    it is served, and an echo without scores is not counted."""
    body = {"prompt": [5] * 4000, "n": 16, "echo": True, "logprobs": 20, "max_tokens": 0}
    refused = assert_openai_error(post(url, "/v1/completions", json=body), 400, "echo")
    assert refused["code"] == "reply_too_large"
    options = server_options(tiny_run, max_echo_scores=30)
    at_limit = {"prompt": [5] * 5, "n": 2, "echo": True, "logprobs": 2}
    assert parse_request(at_limit, False, options, tokenizer, "m").work.echo
    with pytest.raises(APIError) as past:
        parse_request(at_limit | {"prompt": [5] * 6}, False, options, tokenizer, "m")
    assert past.value.status == 400 and past.value.param == "echo"
    assert parse_request(at_limit | {"prompt": [5] * 6, "logprobs": None}, False, options, tokenizer, "m").work.echo


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"logprobs": 2.5}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
        ("/v1/completions", {"echo": True, "session": "s"}, "echo"),
        ("/v1/completions", {"prompt": [1, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": [1, "x"]}, "prompt"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_logprobs_fields_get_400_naming_the_field(url, path, fields, param):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    assert_openai_error(post(url, path, json=body | fields), 400, param)


def test_the_librarys_figures_are_pythons_nine_digits():
    """scores_json.cpp's format_figure against Python's "%.9g", over float32's bit patterns and the edges of its
    integer arithmetic (1e-22 and 1e9, beyond which it hands over to snprintf)."""
    write = library.usable_library().aftgen_format_figure
    rng = np.random.default_rng(9)
    edges = np.float32([0.0, -0.0, 1e9, 999999999.0, 99999999.5, 1e-22, 9.9999999e-23, 1e-4, 9.99999975e-5, 1e-5,
                        0.5, 2**-149, 3.4e38, np.inf, -np.inf, -1.0, -100.0])  # fmt: skip
    any_bits = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    figures = np.concatenate([edges, any_bits, -rng.exponential(3, 50_000).astype(np.float32)])
    out = ctypes.create_string_buffer(32)

    def written(figure: float) -> str:
        length = write(figure, out)
        return out.raw[:length].decode()

    wrong = [v for v in figures[~np.isnan(figures)].tolist() if written(v) != FIGURE % v]
    assert wrong == []


def test_a_request_whose_scores_cannot_be_read_gets_a_500_and_stops_generating(tiny_run, monkeypatch):
    """The engine's records damaged on their way (an engine's fault): the request fails alone, and its row leaves
    the batch at once rather than run on to max_tokens with nobody reading."""
    made = engine_module.token_scores
    monkeypatch.setattr(engine_module, "token_scores", lambda *args: [(t, "zz" + r[2:]) for t, r in made(*args)])
    options = server_options(tiny_run, max_tokens=1 << 20)
    engine = Engine(*load(tiny_run, DEVICE), options, resolve(DEVICE, "fp32"))
    with serving(options, engine) as url:
        response = post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 1 << 20, "logprobs": 2})
        assert response.status_code == 500 and "cannot be read" in response.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while engine.occupied() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.occupied() == 0
        assert post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 3}).status_code == 200
