"""The playground page of `aftgen serve`, driven in Debian's headless Chromium (Playwright's client, no
downloaded browser) against real servers on 127.0.0.1 with a tiny model; one browser for the module."""

from __future__ import annotations

import codecs
import json
import math
import os
import re
import shutil
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from serving import KEY, busy_slots, client, running, wait_for

from aftgen.generation.controls import API_DEFAULTS, CONTROLS, SamplingOptions

CHROMIUM = "/usr/bin/chromium"
# Nothing but the page under test: no sandbox (root in CI), no GPU, no background traffic of the browser's own.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

if not os.path.exists(CHROMIUM) and not os.environ.get("AFTGEN_REQUIRE_BROWSER"):  # .ci/run installs it and sets this
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator:
    """Headless Chromium with a fresh profile (Playwright passes --headless and --user-data-dir itself)."""
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=FLAGS
        )
        context.set_default_timeout(30_000)
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def open_url(tiny_run) -> Iterator[str]:
    with running(tiny_run, api_key=None) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_url(tiny_run) -> Iterator[str]:
    with running(tiny_run) as url:
        yield url


class Playground:
    """One page of the playground, with every request it makes recorded."""

    def __init__(self, browser, url: str):
        self.url, self.page, self.requests = url, browser.new_page(), []
        self.page.on("request", lambda request: self.requests.append(request))
        self.page.goto(f"{url}/")

    def settings(self, **values) -> None:
        for name, value in values.items():
            self.page.fill(f"#{name}", str(value))

    def send(self, text: str) -> None:
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")

    def reply(self, state: str = "done", index: int = -1) -> str:
        """The text of a reply (the last one by default) once it reaches `state`."""
        self.page.wait_for_function(
            "([i, s]) => { const r = [...document.querySelectorAll('.reply')].at(i);"
            " return r && r.dataset.state === s; }",
            arg=[index, state],
        )
        return self.page.locator(".reply .text").nth(index).text_content()

    def tokens(self, index: int = -1) -> list[list[str]]:
        """A reply's token spans: each one's text and tooltip."""
        return self.page.evaluate(
            "i => [...[...document.querySelectorAll('.reply')].at(i).querySelectorAll('.token')]"
            ".map(s => [s.textContent, s.dataset.tip])",
            index,
        )

    def generations(self) -> list:
        return [r for r in self.requests if r.method == "POST" and "/v1/" in r.url]

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def playground(browser, open_url) -> Iterator[Playground]:
    page = Playground(browser, open_url)
    yield page
    page.close()


def test_text_streams_in_and_the_page_asks_nothing_of_anyone_but_the_server(playground, open_url):
    page = playground.page
    page.click("#tab-completion")
    playground.settings(max_tokens=300)
    # The length of the reply's text at every DOM update while it streams.
    page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const reply = document.querySelector('.reply');
            if (reply && reply.dataset.state === 'streaming')
                window.lengths.push(reply.querySelector('.text').textContent.length);
        }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
    }""")
    page.fill("#input", "ROMEO:")
    page.press("#input", "Shift+Enter")  # a new line, not a request
    assert page.input_value("#input") == "ROMEO:\n" and not playground.generations()
    page.press("#input", "Enter")
    text = playground.reply()
    assert json.loads(playground.generations()[0].post_data)["prompt"] == "ROMEO:\n"
    lengths = page.evaluate("window.lengths")
    assert len({n for n in lengths if 0 < n < len(text)}) > 1  # several partial texts shown before the end
    figures = page.text_content(".reply .figures")
    assert json.loads(playground.generations()[0].post_data)["logprobs"] == 5
    spans = playground.tokens()  # the completion route's shape: spans cut at its text_offset
    assert len(spans) == 300 and "".join(span for span, _ in spans) == text
    assert figures.startswith("300 tokens · ") and "tokens/s" in figures and "cached prompt tokens" in figures
    assert playground.requests and all(r.url.startswith(f"{open_url}/") for r in playground.requests)
    assert {r.url.removeprefix(open_url) for r in playground.requests} == {
        "/",
        "/controls",
        "/v1/models",
        "/v1/completions",
    }


def test_the_page_has_every_control_with_the_servers_default_and_range(playground, open_url):
    """The inputs are made from GET /controls: every control of CONTROLS (repeat_last_n included), max_tokens and
    seed, each starting at the command line's default, bounded by its declared range, and sent as typed."""
    described = httpx.get(f"{open_url}/controls", timeout=10).json()["controls"]
    assert [c["name"] for c in described] == [*CONTROLS, "max_tokens", "seed"]
    page = playground.page
    page.wait_for_selector("#repeat_last_n")
    inputs = page.evaluate(
        "() => [...document.querySelectorAll('#controls input')].map(i => [i.id, i.value, i.min, i.max])"
    )
    numbers = {name: float(value) if value else None for name, value, _, _ in inputs}
    assert numbers == {name: control.default for name, control in CONTROLS.items()} | {
        "max_tokens": SamplingOptions.max_new_tokens,
        "seed": None,
    }
    for (name, _, low, high), control in zip(inputs, described, strict=True):
        assert name == control["name"] and float(low) == control["low"], name
        assert (float(high) if high else None) == (control["high"] and float(control["high"])), name  # JS numbers
    assert described[0]["name"] == "temperature" and described[0]["request_default"] == API_DEFAULTS["temperature"]
    playground.page.click("#tab-completion")
    playground.settings(repeat_last_n=8, max_tokens=5)
    playground.send("KING:")
    playground.reply()
    (sent,) = playground.generations()
    body = json.loads(sent.post_data)
    assert body["repeat_last_n"] == 8 and body["max_tokens"] == 5 and "seed" not in body


def test_stop_cancels_the_stream_and_the_server_frees_its_row(playground, open_url):
    playground.settings(max_tokens=20_000)
    playground.page.click("#tab-completion")
    playground.send("JULIET:")
    playground.page.wait_for_function("() => document.querySelector('.reply .text').textContent.length > 20")
    playground.page.click("#stop")
    playground.reply(state="stopped")
    wait_for(lambda: busy_slots(open_url) == 0)
    assert playground.page.is_enabled("#send") and not playground.page.is_enabled("#stop")


def test_temperature_and_seed_give_the_text_the_api_gives(playground, open_url):
    playground.page.click("#tab-completion")
    playground.settings(temperature=0.7, seed=1234, max_tokens=40)
    playground.send("KING:")
    shown = playground.reply()
    (sent,) = playground.generations()
    body = json.loads(sent.post_data)
    assert body["prompt"] == "KING:" and body["temperature"] == 0.7 and body["seed"] == 1234
    sampling = {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "repeat_last_n": 64}  # the page's other settings
    api = client(open_url).completions.create(
        model="tiny", prompt="KING:", max_tokens=40, temperature=0.7, top_p=1.0, seed=1234, extra_body=sampling
    )
    assert shown == api.choices[0].text and shown


def test_a_named_session_continues_on_the_server(playground, open_url):
    playground.settings(session="play", seed=7, max_tokens=15)
    playground.send("Hello there.")
    first = playground.reply()
    playground.send("And then?")
    second = playground.reply()
    bodies = [json.loads(request.post_data) for request in playground.generations()]
    assert [body["messages"] for body in bodies] == [
        [{"role": "user", "content": "Hello there."}],
        [{"role": "user", "content": "And then?"}],  # the session holds the rest: only the new message goes
    ]
    assert all(body["session"] == "play" for body in bodies)
    replayed = []  # the same two requests in a new session, from the API
    for body in bodies:
        body |= {"session": "replay", "stream": False}
        body.pop("stream_options")
        answer = httpx.post(f"{open_url}/v1/chat/completions", json=body, timeout=60).json()
        replayed.append(answer["choices"][0]["message"]["content"])
    assert replayed == [first, second]
    playground.page.click("#reset")
    assert playground.page.locator(".reply").count() == 0
    assert playground.page.input_value("#session").startswith("play-r")


def test_with_an_api_key_the_page_asks_for_it_and_generates_nothing_until_given(browser, keyed_url):
    playground = Playground(browser, keyed_url)
    page = playground.page
    page.wait_for_selector("#keybox.needed")
    playground.send("ROMEO:")
    assert "API key" in page.text_content("#notice")
    assert page.locator(".reply").count() == 0 and not playground.generations()
    page.fill("#key", KEY)
    page.press("#key", "Tab")  # the change event: the page checks the key with the server
    page.wait_for_selector("#keybox:not(.needed)")
    playground.settings(max_tokens=10)
    playground.send("ROMEO:")
    assert playground.reply() is not None
    (sent,) = playground.generations()
    assert sent.headers["authorization"] == f"Bearer {KEY}"
    assert all(request.url.startswith(f"{keyed_url}/") for request in playground.requests)
    playground.close()


def test_the_page_is_served_as_html_for_this_server_only_and_no_webui_turns_it_off(tiny_run, open_url):
    page = httpx.get(f"{open_url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    with running(tiny_run, in_process=True, api_key=None, webui=False) as url:
        assert httpx.get(f"{url}/", timeout=10).status_code == 404


def test_each_token_shows_its_probability_and_alternatives_on_hover_and_by_keyboard(playground, open_url):
    playground.settings(seed=3, max_tokens=30)
    playground.send("Hello there.")
    text = playground.reply()
    (sent,) = playground.generations()
    body = json.loads(sent.post_data)
    assert body["logprobs"] is True and body["top_logprobs"] == 5
    spans = playground.tokens()
    assert "".join(span for span, _ in spans) == text and len(spans) == 30
    percents = [float(re.match(r"chosen ([0-9.e+-]+)% · top 5:\n", tip)[1]) for _, tip in spans]
    assert all(0 < p <= 100 for p in percents) and all(tip.count("\n") == 5 for _, tip in spans)
    body |= {"stream": False}  # the same request from the API: the same tokens, each with its probability
    body.pop("stream_options")
    answer = httpx.post(f"{open_url}/v1/chat/completions", json=body, timeout=60).json()
    content = answer["choices"][0]["logprobs"]["content"]
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a byte-fallback piece: its bytes, as decoded
    assert [span for span, _ in spans] == [decoder.decode(bytes(entry["bytes"])) for entry in content]
    assert percents == pytest.approx([100 * math.exp(entry["logprob"]) for entry in content], abs=0.06, rel=0.01)
    page, first = playground.page, ".reply .token >> nth=0"
    page.hover(first)
    popup = "s => getComputedStyle(s, '::after').content"  # the tooltip, quoted, or 'none' where it is hidden
    assert page.eval_on_selector(first, popup).startswith('"' + spans[0][1].split("\n")[0]) and len(spans[0][1]) > 20
    assert page.eval_on_selector(".reply .token >> nth=1", popup) == "none"
    page.focus(first)
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.textContent") == spans[1][0]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def test_a_schema_typed_in_gives_a_reply_that_follows_it(playground):
    playground.page.fill("#schema", json.dumps(SCHEMA, indent=2))
    playground.settings(seed=5, max_tokens=60)
    playground.send("A number, please.")
    jsonschema.validate(json.loads(playground.reply()), SCHEMA)
    (sent,) = playground.generations()
    assert json.loads(sent.post_data)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "playground", "schema": SCHEMA},
    }


def test_a_schema_that_is_not_json_is_said_beside_it_and_nothing_is_sent(playground):
    page = playground.page
    page.fill("#schema", '{"type": "object",')
    playground.send("A number, please.")
    assert "not JSON" in page.text_content("#schema-error")
    assert not playground.generations() and page.locator(".msg").count() == 0
    assert page.input_value("#input") == "A number, please."  # kept to send again
    page.fill("#schema", "[1]")  # JSON, but no schema: the server's 400 shows as the page's other errors do
    assert page.text_content("#schema-error") == ""
    page.press("#input", "Enter")
    playground.reply(state="error")
    assert "response_format" in page.text_content(".reply .error")
