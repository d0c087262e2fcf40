"""Random JSON thrown at every field of both routes of `aftgen serve`: never a 500, always OpenAI's error
shape, and the server still answers afterwards. The app runs in-process under Starlette's TestClient
(no socket), with a tiny model and small limits, so 500 examples take seconds. Then sampling settings at
the edges of their ranges, each row beside another: every row finishes, and the other draws what it
draws alone."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serving import LONG, assert_openai_error, post
from starlette.testclient import TestClient

from aftgen.api import load
from aftgen.chat import ROLES
from aftgen.device import resolve
from aftgen.generation.controls import CONTROLS, GREEDY_BELOW, Control, SamplingOptions
from aftgen.serve.app import Server
from aftgen.serve.engine import Engine
from aftgen.serve.options import ServeOptions
from aftgen.serve.schema import IGNORED, NEUTRAL, APIError, parse_request, sampling_fields, structured_outputs
from aftgen.serve.work import Done, Failed, Finished, Text, Work
from aftgen.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

KEY = "property-key"
OPTIONS = dict(api_key=KEY, max_tokens=4, max_prompt_tokens=64, max_body_bytes=1 << 16, parallel=4, queue=4)
EXAMPLES = 500


@pytest.fixture(scope="module")
def http(tiny_run, tmp_path_factory) -> Iterator[TestClient]:
    model, tokenizer = load(tiny_run)
    sessions = tmp_path_factory.mktemp("sessions")
    options = ServeOptions(model=str(tiny_run), sessions_dir=sessions, max_session_files=4, cache_mb=1, **OPTIONS)
    engine = Engine(model, tokenizer, options, resolve("cpu", "fp32"))
    app = Server(engine, "tiny").app()
    with TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


# float32 rounds these to 0 or to a subnormal: where a division or a comparison goes wrong
TINY_FLOATS = [5e-324, 1e-310, 2.2250738585072014e-308, 1e-300, 1e-45, 1e-39, 1.1754943508222875e-38]


def at_edges(control: Control) -> st.SearchStrategy:
    """A control's values (CONTROLS' range), often at its edges: its ends and the floats just inside them,
    subnormals and 1e-300, and either side of the temperature below which sampling is greedy."""
    allowed = control.range
    if control.type is int:
        high = (1 << 64) if allowed.high is None else allowed.high
        return st.sampled_from([allowed.low, allowed.low + 1, high]) | st.integers(allowed.low, high)
    low, high = allowed.low, allowed.high
    edges = [low, math.nextafter(low, high), high, math.nextafter(high, low), *TINY_FLOATS]
    edges += [GREEDY_BELOW, math.nextafter(GREEDY_BELOW, 0)]
    return st.sampled_from([edge for edge in edges if edge in allowed]) | st.floats(low, high).filter(
        lambda value: value in allowed
    )


surrogates = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])  # JSON can spell them; UTF-8 cannot
any_text = st.text(st.characters(exclude_categories=()) | surrogates, max_size=12)
clean_text = st.text(st.characters(codec="utf-8"), max_size=30)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=8,
)
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": any_text}), max_size=3)
odd_message = st.fixed_dictionaries(
    {"role": st.sampled_from([*ROLES, "robot"]), "content": any_text | parts | json_values},
    optional={"name": any_text, "extra": json_values},
)
message = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": clean_text})
VALID = {  # values each field accepts, so that most requests get past most checks and generate
    "prompt": clean_text,
    "messages": st.lists(message, min_size=1, max_size=3),
    "model": st.just("tiny"),
    "max_tokens": st.integers(0, 4),
    "max_completion_tokens": st.integers(0, 4),
    "n": st.integers(1, 4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=4),
    "seed": st.integers(0, (1 << 63) - 1),
    "session": st.sampled_from(["a", "b", "c", "d", "e", "f"]),
} | {name: at_edges(control) for name, control in CONTROLS.items()}
VALID |= {name: st.sampled_from(values) for name, values in NEUTRAL.items()}
NEAR_VALID = {  # just past each range, or the wrong shape
    "prompt": any_text | st.lists(any_text, max_size=2),
    "messages": st.lists(odd_message | message, max_size=3),
    "max_tokens": st.integers(-2, 6),
    "n": st.integers(-1, 6),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-5, 1 << 64),
    "stop": any_text | st.lists(any_text, max_size=5),
    "session": st.sampled_from(["../x", ".hidden", "x" * 65, "", "a b"]),
}
FIELDS = sorted(set(sampling_fields(ServeOptions())) | set(VALID) | set(IGNORED))


def value(draw, name: str) -> object:
    """Mostly a valid value, sometimes one just past it, sometimes any JSON at all."""
    roll = draw(st.integers(0, 9))
    if roll < 7 and name in VALID:
        return draw(VALID[name])
    if roll < 9 and name in NEAR_VALID:
        return draw(NEAR_VALID[name])
    return draw(json_values)


@st.composite
def bodies(draw, chat: bool) -> object:
    """A request body: its required field and a few others, known or not; now and then not an object."""
    if draw(st.integers(0, 19)) == 0:
        return draw(json_values)
    required = ["messages" if chat else "prompt"] if draw(st.integers(0, 9)) else []
    names = draw(st.lists(st.sampled_from(FIELDS) | any_text, max_size=3, unique=True))
    if draw(st.integers(0, 3)) == 0:  # every sampling control at once, where their edges compound
        names += [name for name in CONTROLS if name not in names]
    return {name: value(draw, name) for name in required + names}


def assert_openai_shape(response: httpx.Response) -> None:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), chat=st.booleans())
def test_random_json_never_gets_a_500_and_errors_keep_openai_shape(http, data, chat):
    body = data.draw(bodies(chat))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    content = json.dumps(body).encode()  # NaN and infinities as JavaScript spells them, surrogates escaped
    response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    event(f"status {response.status_code}")  # --hypothesis-show-statistics: how many got how far
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert_openai_shape(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        sent = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert sent[-1] == "[DONE]"
        for chunk in map(json.loads, sent[:-1]):
            assert "error" not in chunk, chunk
    else:
        assert response.json()["choices"]


def test_the_server_answers_after_the_random_requests(http):
    """Run after the property test (file order): nothing is left busy or queued, and it still generates."""
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["slots_busy"] == 0 and health["queued"] == 0
    assert health["session_files"] <= 4
    reply = http.post("/v1/completions", json={"prompt": "KING:", "max_tokens": 3})
    assert reply.json()["usage"]["completion_tokens"] == 3


TOKENS = 6
BESIDE = dict(seed=7)  # the default controls: drawn together with each edge row that leaves its filters at theirs


@pytest.fixture(scope="module")
def beside(tiny_run) -> tuple[Engine, str]:
    """An engine driven turn by turn, and what the row beside the edge rows draws alone."""
    model, tokenizer = load(tiny_run)
    engine = Engine(model, tokenizer, ServeOptions(cache_mb=0, parallel=4), resolve("cpu", "fp32"))
    return engine, texts(engine, [BESIDE])[0]


def texts(engine: Engine, settings: list[dict]) -> list[str]:
    """Each row's text, all generating at once from one prompt; every row must finish, none fail."""
    events: list = []
    engine.publish = events.extend
    prompt = engine.tokenizer.encode("KING:")
    tickets = [engine.submit(Work(prompt, SamplingOptions(max_new_tokens=TOKENS, **each))) for each in settings]
    for _ in range(4 * TOKENS):
        if all(any(owner is ticket and isinstance(e, (Done, Failed)) for owner, e in events) for ticket in tickets):
            break
        engine.turn()
    assert not [event for _, event in events if isinstance(event, Failed)], events
    mine = [[event for owner, event in events if owner is ticket] for ticket in tickets]
    assert all([event.tokens for event in each if isinstance(event, Finished)] == [TOKENS] for each in mine), events
    return ["".join(event.text for event in each if isinstance(event, Text)) for each in mine]


@st.composite
def edge_settings(draw) -> dict:
    """Some controls at the edges of their ranges, the others at their defaults."""
    names = draw(st.lists(st.sampled_from(list(CONTROLS)), max_size=len(CONTROLS), unique=True))
    return {name: draw(at_edges(CONTROLS[name])) for name in names}


@settings(max_examples=EXAMPLES // 2, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(edge_rows=st.lists(edge_settings(), min_size=1, max_size=3), seed=st.integers(0, 1 << 32))
def test_sampling_settings_at_their_edges_finish_and_leave_the_row_beside_them_alone(beside, edge_rows, seed):
    engine, alone = beside
    assert texts(engine, [BESIDE, *[each | {"seed": seed} for each in edge_rows]])[0] == alone


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": LONG + 1}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"seed": -1}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1}, "min_p"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"session": "../etc"}, "session"),
        ({"logprobs": 21}, "logprobs"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"prompt": "KING " * 400}, "prompt"),
    ],
)
def test_bad_fields_get_400_in_openai_shape(url, fields, param):
    assert_openai_error(post(url, "/v1/completions", json={"prompt": "x"} | fields), 400, param)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "KING\ud800"}, "prompt"),
        ("/v1/completions", {"prompt": ["\udfff"]}, "prompt[0]"),
        ("/v1/completions", {"prompt": "x", "model": "\ud800"}, "model"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", "\ud800"]}, "stop[1]"),
        ("/v1/completions", {"prompt": "x", "\ud800": 1}, "\\ud800"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]},
            "messages[0].content[0].text",
        ),  # fmt: skip
    ],
)
def test_text_that_is_not_unicode_gets_400_naming_its_field(url, path, body, param):
    """JSON can spell a lone surrogate ("\\ud800"); UTF-8, the tokenizer and the error answer cannot."""
    error = assert_openai_error(post(url, path, content=json.dumps(body).encode()), 400, param)
    assert "surrogate" in error["message"]


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_whose_bytes_cannot_fit_is_refused_before_it_is_tokenized(tiny_run, monkeypatch, chat):
    """A 900 KB prompt is refused from its length in bytes (no token stands for more than the longest
    piece); one near the limit is still tokenized and checked in tokens."""
    _, tokenizer = load(tiny_run)
    options = ServeOptions(max_prompt_tokens=300)

    def body(text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}

    near = "KING " * 400  # 2,000 bytes: a few hundred tokens, so its bytes alone cannot tell
    assert len(near) // tokenizer.longest_piece < 300
    with pytest.raises(APIError, match="the prompt is \\d+ tokens"):
        parse_request(body(near), chat, options, tokenizer, "tiny")
    encoded = []
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text: encoded.append(len(text)) or [])
    with pytest.raises(APIError, match="the prompt is at least \\d+ tokens") as refused:
        parse_request(body("KING " * 180_000), chat, options, tokenizer, "tiny")
    assert encoded == [] and refused.value.code == "context_length_exceeded"
    assert refused.value.param == ("messages" if chat else "prompt")


def test_a_choice_past_llguidance_s_row_is_refused_before_anything_runs():
    """A choice is one row of llguidance's parser, one item a string and one more: 2,000 items at most."""
    with pytest.raises(APIError) as refused:
        structured_outputs("structured_outputs", {"choice": [f"w{i}" for i in range(2001)]})
    assert refused.value.status == 400 and refused.value.param == "structured_outputs.choice"
    assert structured_outputs("structured_outputs", {"choice": [f"w{i}" for i in range(1999)]}).kind == "choice"
