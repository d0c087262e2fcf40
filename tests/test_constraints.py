"""Structured output: every constrained reply parses, validates or matches, across seeds and temperatures, in
both routes and on the command line, and a constraint that cannot be compiled or followed is a 400 naming its
field (a constrained row among free ones, and one that breaks or costs too much while drawing: tests/serve/
test_engine.py)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from conftest import DEVICE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import KEY, PERSON, client, post, running
from typer.testing import CliRunner

from aftgen.api import load
from aftgen.cli import app
from aftgen.constraints import ANY_JSON_OBJECT, Constraint, compiled
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.loop import generate
from aftgen.generation.prompt import read_prompt
from aftgen.model import AFTLM
from aftgen.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

PHONE = "[0-9]{3}-[0-9]{4}"
TEMPERATURES = (0.0, 0.7, 1.0, 1.5)
CHOICES = 8  # choices a request: choice i draws from seed + i


@pytest.fixture(scope="module")
def url(tiny_run) -> Iterator[str]:
    with running(tiny_run) as url:
        yield url


@pytest.mark.parametrize("chat", [False, True])
def test_every_reply_to_a_json_schema_parses_and_validates(url, chat):
    openai = client(url)
    for seed, temperature in enumerate(TEMPERATURES):
        shape = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        common = dict(model="tiny", n=CHOICES, seed=seed, temperature=temperature, max_tokens=200)
        if chat:
            question = [{"role": "user", "content": "Who?"}]
            reply = openai.chat.completions.create(messages=question, response_format=shape, **common)
            texts = [(choice.message.content, choice.finish_reason) for choice in reply.choices]
        else:  # OpenAI's legacy route has no response_format; aftgen's takes it as vLLM's does
            reply = openai.completions.create(prompt="KING:", extra_body={"response_format": shape}, **common)
            texts = [(choice.text, choice.finish_reason) for choice in reply.choices]
        for text, reason in texts:
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    ("field", "matches"),
    [
        ({"structured_outputs": {"regex": PHONE}}, lambda text: re.fullmatch(PHONE, text)),
        ({"grammar": 'root ::= "yes" | "no" | [0-9]+ "%"'}, lambda text: re.fullmatch(r"yes|no|[0-9]+%", text)),
        ({"structured_outputs": {"choice": ["north", "south"]}}, lambda text: text in ("north", "south")),
        ({"json_schema": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}, json.loads),
    ],
)
def test_every_reply_to_a_regex_grammar_or_choice_matches(url, field, matches):
    for seed, temperature in enumerate(TEMPERATURES):
        body = dict(prompt="KING:", n=CHOICES, seed=seed, temperature=temperature, max_tokens=200, **field)
        reply = post(url, "/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        for choice in reply.json()["choices"]:
            assert choice["finish_reason"] == "stop" and matches(choice["text"]), choice


@pytest.fixture(scope="module")
def tiny(tiny_run) -> tuple[AFTLM, Tokenizer]:
    """The tiny run's model and tokenizer."""
    return load(tiny_run)


def test_json_object_asks_for_an_object(url, tiny):
    """Any object: its keys are free text, where a tiny model can wander past max_tokens. Those that end
    validate; those cut short are text that llguidance's matcher for the schema takes, token by token."""
    body = dict(prompt="KING:", n=CHOICES, seed=0, max_tokens=60, response_format={"type": "json_object"})
    for choice in post(url, "/v1/completions", json=body).json()["choices"]:
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["text"]), {"type": "object"})
        else:
            tokenizer = tiny[1]
            ids = tokenizer.encode(choice["text"])
            matcher = compiled(Constraint("json_schema", ANY_JSON_OBJECT), tokenizer).deep_copy()
            assert tokenizer.decode(ids) == choice["text"] and matcher.consume_tokens(ids), choice


def test_a_stream_follows_the_schema_too(url):
    chunks = client(url).completions.create(
        model="tiny", prompt="KING:", seed=1, max_tokens=200, stream=True, extra_body={"json_schema": PERSON}
    )
    jsonschema.validate(json.loads("".join(chunk.choices[0].text for chunk in chunks)), PERSON)


def test_a_constraint_cut_short_ends_with_length(url):
    reply = post(url, "/v1/completions", json=dict(prompt="KING:", max_tokens=3, json_schema=PERSON)).json()
    assert reply["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
        ({"json_schema": {"type": "no such type"}}, "json_schema"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"grammar": 'root ::= "a"', "json_schema": PERSON}, "grammar"),
        ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs"),  # accepts no text
        ({"structured_outputs": {"grammar": 'start: x\nx: x "a"'}}, "structured_outputs"),  # nor this
        ({"json_schema": {"$ref": "#"}}, "json_schema"),  # nor a schema that is only itself
        ({"grammar": 'root ::= "a" root'}, "grammar"),  # past llguidance's limits at its first token
    ],
)
def test_a_constraint_that_cannot_be_compiled_or_followed_is_a_400_naming_its_field(url, field, param):
    reply = post(url, "/v1/completions", json=dict(prompt="KING:", max_tokens=4, **field))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_constraint_leaves_the_requests_beside_it_alone(url, stream):
    """The issue's: a grammar past llguidance's limits beside free requests, on one server at once."""
    free = dict(prompt="KING:", max_tokens=20, stream=stream)
    shaped = dict(prompt="", max_tokens=200, stream=stream, structured_outputs={"grammar": 'root ::= "a" root'})

    async def all_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
            sent = [http.post(f"{url}/v1/completions", json=body) for body in [shaped] + [free] * CHOICES]
            return await asyncio.gather(*sent)

    refused, *answered = asyncio.run(all_at_once())
    assert refused.status_code == 400, refused.text
    for reply in answered:
        assert reply.status_code == 200 and "error" not in reply.text, reply.text


REGEX_PARTS = st.sampled_from(["[0-9]", "[a-z]", "[A-Z]", "(ab|cd)", "-", " ", r"\.", "x"])


@st.composite
def regexes(draw) -> str:
    """A small regular expression: a few parts, each repeated a bounded number of times."""
    parts = draw(st.lists(st.tuples(REGEX_PARTS, st.integers(1, 3), st.integers(0, 2)), min_size=1, max_size=4))
    return "".join(f"{part}{{{low},{low + extra}}}" for part, low, extra in parts)


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(pattern=regexes(), seed=st.integers(0, 1 << 32), temperature=st.sampled_from(TEMPERATURES))
def test_generated_text_matches_small_regexes(tiny, pattern, seed, temperature):
    model, tokenizer = tiny
    context = read_prompt(model, tokenizer, "KING:", seed=seed)
    options = SamplingOptions(max_new_tokens=100, temperature=temperature, constraint=Constraint("regex", pattern))
    assert re.fullmatch(pattern, "".join(generate(model, tokenizer, context, options)))


def test_sample_writes_text_that_matches_its_regex_or_schema(tiny_run, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    base = ["sample", "--model", str(tiny_run), "--device", DEVICE, "--prompt", "KING:", "--no-echo"]
    several = [*base, "--seed", "1", "--temperature", "1.0", "--num-samples", "4"]
    matched = CliRunner().invoke(app, [*several, "--regex", PHONE])
    assert matched.exit_code == 0, matched.output
    assert all(re.fullmatch(PHONE, text.strip()) for text in matched.stdout.split("---")), matched.stdout
    shaped = CliRunner().invoke(app, [*several, "--json-schema", str(schema)])
    assert shaped.exit_code == 0, shaped.output
    for text in shaped.stdout.split("\n---\n"):
        jsonschema.validate(json.loads(text), PERSON)
    refused = CliRunner().invoke(app, [*base, "--regex", "[0-9"])
    assert refused.exit_code == 2 and refused.output.startswith("error: the regex cannot be compiled"), refused.output


@pytest.mark.parametrize(("flag", "value"), [("--regex", r"[^\s\S]"), ("--grammar", 'start: x\nx: x "a"')])
def test_sample_refuses_a_constraint_that_accepts_no_text(tiny_run, tmp_path, flag, value):
    if flag == "--grammar":
        (tmp_path / "g.lark").write_text(value)
        value = str(tmp_path / "g.lark")
    base = ["sample", "--model", str(tiny_run), "--device", DEVICE, "--prompt", "KING:", "--no-echo"]
    refused = CliRunner().invoke(app, [*base, flag, value])
    assert refused.exit_code == 2 and refused.output.count("\n") == 1, refused.output
    assert refused.output.startswith(f"error: the {flag[2:]} accepts no text"), refused.output
