"""aftgen.serve.app: OpenAI's routes over a real server on 127.0.0.1 (in-process uvicorn, ephemeral port) and a
tiny model: statuses in OpenAI's error shape, the key, /health, the model routes and clients that go away."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import DEVICE
from serving import (
    AUTH,
    KEY,
    assert_openai_error,
    client,
    health,
    library_text,
    post,
    server_options,
    serving,
    slow_compile,
    wait_for,
)

from aftgen.api import load
from aftgen.device import resolve
from aftgen.serve.app import Server
from aftgen.serve.batch import CompiledBatchStep
from aftgen.serve.engine import Engine
from aftgen.serve.options import ServeOptions

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def test_errors_get_their_status_in_openai_shape(url):
    assert_openai_error(post(url, "/v1/completions", content=b'{"prompt": "x",'), 400)
    assert_openai_error(post(url, "/v1/completions", json=["x"]), 400)
    assert_openai_error(post(url, "/v1/completions", content=b"[" * 4000), 400)
    assert_openai_error(post(url, "/v1/completions", content=b'{"prompt": "\xff"}'), 400)
    assert_openai_error(post(url, "/v1/completions", json={"max_tokens": 3}), 400, "prompt")
    assert_openai_error(post(url, "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}), 400,
                        "messages[0].role")  # fmt: skip
    assert_openai_error(post(url, "/v1/completions", key=None, json={"prompt": "x"}), 401)
    wrong = assert_openai_error(post(url, "/v1/completions", key="nope", json={"prompt": "x"}), 401)
    assert wrong["code"] == "invalid_api_key"
    assert_openai_error(httpx.get(f"{url}/v1/models"), 401)
    assert_openai_error(post(url, "/v1/completions", content=b"x" * 5000), 413)
    assert_openai_error(post(url, "/v1/completions", json={"prompt": "x", "model": "gpt-9"}), 404, "model")
    assert_openai_error(post(url, "/v1/nothing", json={}), 404)
    assert_openai_error(httpx.get(f"{url}/v1/completions"), 405)
    with pytest.raises(openai.BadRequestError) as raised:  # the official client reads the shape
        client(url).completions.create(model="x", prompt="x", temperature=9)
    assert "temperature" in str(raised.value)


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_a_body_that_is_not_declared_json_gets_415(url, content_type):
    """What a cross-site page can make a browser send without a CORS preflight is refused unread."""
    headers = {"Content-Type": content_type} if content_type else {}
    with httpx.Client(timeout=60) as http:
        request = http.build_request(
            "POST", f"{url}/v1/completions", content=b'{"prompt": "x"}', headers=AUTH | headers
        )
        assert request.headers.get("Content-Type") == content_type
        response = http.send(request)
    error = assert_openai_error(response, 415)
    assert "application/json" in error["message"]
    with_charset = {"Content-Type": "application/json; charset=utf-8"}
    assert post(url, "/v1/completions", headers=with_charset, json={"prompt": "x", "max_tokens": 1}).status_code == 200
    preflight = httpx.options(f"{url}/v1/completions", headers={"Origin": "http://example.com"}, timeout=10)
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers


def test_a_chunked_body_over_the_limit_gets_413(url):
    """No Content-Length to refuse it by: the body is counted as it arrives."""

    def pieces() -> Iterator[bytes]:
        for _ in range(50):
            yield b" " * 1000

    response = post(url, "/v1/completions", content=pieces())
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert_openai_error(response, 413)


def test_the_model_route_describes_the_model_served_and_only_it(url, tiny_run):
    card = httpx.get(f"{url}/v1/models/{tiny_run.name}", headers=AUTH, timeout=10)
    assert card.status_code == 200
    assert card.json() | {"created": 0} == {"id": tiny_run.name, "object": "model", "created": 0, "owned_by": "aftgen"}
    other = assert_openai_error(httpx.get(f"{url}/v1/models/gpt-9", headers=AUTH, timeout=10), 404, "model")
    assert other["code"] == "model_not_found" and "gpt-9" in other["message"]
    assert_openai_error(httpx.get(f"{url}/v1/models/{tiny_run.name}", timeout=10), 401)


def test_a_client_gone_while_its_body_is_read_is_no_error(tiny_run):
    """The app returns quietly (a 499 nobody reads) instead of raising ClientDisconnect for uvicorn to log."""
    model, tokenizer = load(tiny_run)
    engine = Engine(model, tokenizer, ServeOptions(api_key=KEY), resolve("cpu", "fp32"))
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers, "query_string": b""}
    arriving = [{"type": "http.request", "body": b'{"prompt":', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return arriving.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(Server(engine, "tiny").app()(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499


def test_health_names_the_model_only_to_a_client_with_the_key(url, tiny_run):
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
    assert httpx.get(f"{url}/health", headers={"Authorization": "Bearer wrong"}, timeout=10).json() == {"status": "ok"}
    figures = health(url)
    assert figures["model"] == tiny_run.name
    step = {name: figures[name] for name in ("step", "batch_invariant", "step_note")}  # the tests' --no-compile
    assert step == {"step": "eager", "batch_invariant": False, "step_note": "--no-compile"}


def test_health_is_503_while_the_step_compiles_and_a_request_waits_for_it(tiny_run, monkeypatch):
    """As llama.cpp's 'Loading model': /health says why it is not ready, a request sent meanwhile waits and then
    gets the compiled step's text, and /health with the key names the step that serves."""
    model, tokenizer = load(tiny_run, device=DEVICE)
    done, calls = slow_compile(monkeypatch, model)
    options, placement = server_options(tiny_run), resolve(DEVICE, "fp32")
    engine = Engine(model, tokenizer, options, placement, CompiledBatchStep(model, options.parallel, placement, 0.1))
    body = {"prompt": "KING:", "max_tokens": 8, "seed": 3, "temperature": 0.8}
    with serving(options, engine) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = httpx.get(f"{url}/health", timeout=10)
        assert waiting.status_code == 503 and waiting.json() == {"status": "compiling the step"}
        reply = pool.submit(post, url, "/v1/completions", json=body)
        wait_for(lambda: engine.queued == 1)
        done.set()
        assert reply.result().json()["choices"][0]["text"] == library_text(
            tiny_run, "KING:", max_new_tokens=8, seed=3, temperature=0.8
        )
        figures = health(url)
    assert calls and figures["step"] == "compiled" and figures["batch_invariant"] is False
    assert "step_note" not in figures
