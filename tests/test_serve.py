"""`aftgen serve`: a real server on 127.0.0.1 (in-process uvicorn, ephemeral port) and a tiny model,
talked to with the official openai client and with plain HTTP for the error cases."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import typer
from conftest import DEVICE, on_device
from serving import (
    AUTH,
    KEY,
    LONG,
    Stream,
    assert_openai_error,
    busy_slots,
    client,
    engine_processes,
    health,
    library_text,
    post,
    running,
    server_options,
    serving,
    slow_compile,
    wait_for,
)
from typer.testing import CliRunner

import aftgen.options
from aftgen.api import load
from aftgen.bench.measure import tree_memory_mb
from aftgen.cli import app
from aftgen.device import resolve
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.loop import generate
from aftgen.generation.prompt import read_prompt
from aftgen.model import AFTLM, AFTConfig, clone_state
from aftgen.serve.app import Server
from aftgen.serve.batch import Batch, CompiledBatchStep
from aftgen.serve.engine import Engine
from aftgen.serve.options import ServeOptions
from aftgen.serve.schema import APIError, parse_request
from aftgen.serve.sessions import SUFFIX, SessionStore
from aftgen.state import load_state
from aftgen.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.fixture(scope="module")
def url(tiny_run) -> Iterator[str]:
    """The module's server; when it stops, its engine's process is gone too (where /proc tells)."""
    tracked = Path("/proc/self/task").exists()
    before = set(engine_processes()) if tracked else set()
    with running(tiny_run) as base:
        children = set(engine_processes()) - before if tracked else set()
        yield base
    wait_for(lambda: not children & set(engine_processes() if tracked else []))


@pytest.mark.parametrize("mixer", ["aft_local", "aft_simple"])
def test_batched_step_matches_each_sequence_alone(mixer):
    """Rows at different positions join and leave, one or two at once; each row's logits stay within 1e-4 of
    its own batch-1 step (so greedy picks agree), and a row that leaves has its own state and position back."""
    torch.manual_seed(0)
    config = AFTConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=4, window=5, context_length=16, mixer=mixer)
    model = on_device(AFTLM(config).eval())
    with torch.inference_mode():
        positions = [3, 8, 13, 1, 6]
        alone = [model.prefill(torch.randint(0, 64, (1, n)), last_only=True)[1] for n in positions]
        batch = Batch(model, capacity=4)
        batch.add([(i, clone_state(alone[i])) for i in (0, 1, 2)])
        joins = {5: 3, 11: 4}
        leaves = {11: [1], 17: [1], 20: [0, 1]}  # middle rows (the last fills their place), then two at once
        for t in range(24):
            if t in leaves:
                leaving = [batch.rows[r] for r in leaves[t]]
                for row in leaving:
                    state, position = batch.state_of(row)
                    assert position == positions[row]
                    for mine, theirs in zip(state, alone[row], strict=True):
                        for name in mine:
                            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-4)
                batch.remove(leaving)
                assert not set(leaving) & set(batch.rows)
            if t in joins:
                batch.add([(joins[t], clone_state(alone[joins[t]]))])
            tokens = torch.randint(0, 64, (len(batch),))
            logits = batch.step(tokens)
            for r, i in enumerate(batch.rows):
                own, _ = model.step(tokens[r : r + 1], alone[i])
                positions[i] += 1
                assert (own - logits[r : r + 1]).abs().max() < 1e-4
                assert own.argmax() == logits[r].argmax()


def test_completions_and_chat_through_the_openai_client(url, tiny_run):
    api = client(url)
    assert [m.id for m in api.models.list().data] == [tiny_run.name]
    whole = api.completions.create(model=tiny_run.name, prompt="KING:", max_tokens=30, seed=7, temperature=0.8)
    assert whole.choices[0].text == library_text(tiny_run, "KING:", max_new_tokens=30, seed=7, temperature=0.8)
    assert whole.choices[0].finish_reason == "length"
    usage, tokenizer = whole.usage, load(tiny_run)[1]
    assert usage.prompt_tokens == 1 + len(tokenizer.encode("KING:"))  # BOS, then the prompt
    assert (usage.completion_tokens, usage.total_tokens) == (30, usage.prompt_tokens + 30)
    chunks = list(
        api.completions.create(model=tiny_run.name, prompt="KING:", max_tokens=30, seed=7, temperature=0.8, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    several = api.completions.create(model=tiny_run.name, prompt="KING:", max_tokens=30, seed=7, temperature=0.8, n=3)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert several.choices[0].text == whole.choices[0].text and several.usage.completion_tokens == 90

    llama_cpp_fields = dict(top_k=5, min_p=0.05, repeat_penalty=1.3, repeat_last_n=16)
    tuned = api.completions.create(
        model=tiny_run.name, prompt="KING:", max_tokens=30, seed=3, extra_body=llama_cpp_fields
    )
    assert tuned.choices[0].text == library_text(tiny_run, "KING:", max_new_tokens=30, seed=3, temperature=1.0,
                                                 **llama_cpp_fields)  # fmt: skip

    greedy = api.completions.create(model=tiny_run.name, prompt="KING:", max_tokens=60, temperature=0)
    stop = greedy.choices[0].text[20:23]
    stopped = api.completions.create(model=tiny_run.name, prompt="KING:", max_tokens=60, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == greedy.choices[0].text[: greedy.choices[0].text.index(stop)]

    messages = [{"role": "user", "content": "KING:"}]
    chat = api.chat.completions.create(model=tiny_run.name, messages=messages, max_tokens=40, seed=1)
    as_aftgen_chat = library_text(tiny_run, "KING:\n", max_new_tokens=40, seed=1, temperature=1.0, stop=("\n\n",))
    assert chat.choices[0].message.content == as_aftgen_chat
    streamed = list(
        api.chat.completions.create(
            model=tiny_run.name,
            messages=messages,
            max_tokens=40,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert content == chat.choices[0].message.content and "\n\n" not in content  # the default stop: a blank line
    assert streamed[-1].usage.completion_tokens == chat.usage.completion_tokens > 0


def test_seeded_request_gives_the_same_text_alone_and_among_eight_others(url, tiny_run):
    """Four others are generating when it starts and four more join while it runs: the same text, sampled
    and greedy. Everything in the batch asks for more tokens than the test reads, so all nine share it."""
    api, model = client(url), tiny_run.name
    asks = [dict(seed=11, temperature=0.9), dict(temperature=0)]
    alone = [
        api.completions.create(model=model, prompt="NURSE:", max_tokens=100, **ask).choices[0].text for ask in asks
    ]
    for ask, text in zip(asks, alone, strict=True):
        with httpx.Client(timeout=60) as http:
            others = [
                Stream(http, url, "JULIET: " * (i + 1), LONG, **ask | {"seed": i}) for i in range(4)
            ]  # drawn alike
            for stream in others:
                stream.texts(1)
            mine = Stream(http, url, "NURSE:", LONG, **ask)
            pieces = mine.texts(1)
            others += [Stream(http, url, "ROMEO:\n" * (i + 1), LONG, temperature=0.5) for i in range(4)]
            assert busy_slots(url) == 9  # all nine in the batch at once
            while len("".join(pieces)) < len(text) + 8:
                more = mine.texts(1)
                assert more, "the stream ended early"
                pieces += more
            for stream in [mine, *others]:
                stream.close()
        assert "".join(pieces).startswith(text)


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


def test_named_session_continues_after_a_restart_as_if_never_stopped(tiny_run, tmp_path):
    def turn(url: str, session: str, prompt: str, **fields) -> str:
        reply = post(url, "/v1/completions", json={"prompt": prompt, "max_tokens": 25, "session": session} | fields)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    with running(tiny_run, sessions_dir=tmp_path) as url:
        first = turn(url, "alice", "KING:", seed=3)
        http = httpx.Client(timeout=60)
        held = Stream(http, url, "x", LONG, session="carol")
        held.texts(1)
        busy = assert_openai_error(post(url, "/v1/completions", json={"prompt": "y", "session": "carol"}), 409)
        assert busy["code"] == "session_busy"
        held.close()
        http.close()
    model, tokenizer = load(tiny_run, device=DEVICE)  # an `aftgen sample --save-state` file: the library goes on
    context = read_prompt(model, tokenizer, " and", load_state(tmp_path / f"alice{SUFFIX}", model, tokenizer))
    options = SamplingOptions(max_new_tokens=25, temperature=1.0)
    by_the_library = "".join(generate(model, tokenizer, context, options, final=False))
    with running(tiny_run, sessions_dir=tmp_path) as url:  # restarted
        assert turn(url, "bob", "KING:", seed=3) == first
        after_restart = turn(url, "alice", " and")
        assert turn(url, "bob", " and") == after_restart  # bob never stopped
    assert after_restart == by_the_library and len(after_restart) > 5


def test_every_serve_option_is_declared_once_and_read_by_the_cli_and_the_reference():
    """Each field of ServeOptions is an option with its help and panel; `serve --help` lists each with the
    declared default, and docs/reference.md holds the table made from the same declaration."""
    declared = aftgen.options.declared(ServeOptions)
    assert set(declared) == {f.name for f in dataclasses.fields(ServeOptions)}
    command = typer.main.get_command(app).commands["serve"]
    by_name = {parameter.name: parameter for parameter in command.params}
    for name, (_, default, declaration) in declared.items():
        assert by_name[name].default == default and by_name[name].help == declaration.help, name
    reference = (Path(__file__).parent.parent / "docs" / "reference.md").read_text(encoding="utf-8")
    table = aftgen.options.reference_table(ServeOptions)
    assert table in reference, "docs/reference.md's serve options table is not the declaration's:\n" + table


def test_serve_refuses_bad_options_and_a_missing_extra_in_one_line(monkeypatch):
    result = CliRunner().invoke(app, ["serve", "--parallel", "0"])
    assert result.exit_code == 2 and "error: --parallel must be in [1, 4096], got 0" in result.output
    for option in ("--parallel", "--queue", "--max-prompt-tokens", "--prompt-chunk"):
        result = CliRunner().invoke(app, ["serve", option, str(1 << 64)])
        assert result.exit_code == 2 and f"error: {option} must be in [" in result.output, option
    real = __import__("importlib").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 2 and "pip install 'aftgen[serve]'" in result.output


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


@pytest.fixture
def never_serve(monkeypatch) -> None:
    """A start-up check that lets bad options through fails the test instead of serving forever."""

    def serve(*args) -> None:
        pytest.fail("aftgen serve started")

    monkeypatch.setattr("aftgen.serve.server.serve", serve)


@pytest.mark.parametrize("key", ["", " secret ", "two words", "clé-秘密", "line\nbreak", "bell\x07", "tab\tkey",
                                 "byte\udcff"])  # fmt: skip
def test_serve_refuses_an_api_key_no_client_can_send_at_start_up(key, never_serve):
    """Printable ASCII without spaces only ("\udcff": how Python hands over a non-UTF-8 byte of argv)."""
    result = CliRunner().invoke(app, ["serve", "--api-key", key])
    assert result.exit_code == 2 and result.output.startswith("error: --api-key")
    assert len(result.output.splitlines()) == 1 and (not key or key not in result.output)  # a secret is not echoed


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


def closed_by_server(sock: socket.socket, until: float) -> bool:
    """Whether the server closes this connection (after any answer it sends) before `until` (monotonic)."""
    while time.monotonic() < until:
        sock.settimeout(max(until - time.monotonic(), 0.01))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


def test_slow_clients_are_disconnected_while_others_are_served(tiny_run):
    """Forty clients send half their headers, one half its body, one nothing: each is closed within a
    few read timeouts (the body's gets a 408 first), and a normal client is served meanwhile."""
    with running(tiny_run, in_process=True, read_timeout=1.0) as url:
        address = urllib.parse.urlsplit(url)[1].split(":")
        slow = [socket.create_connection(address) for _ in range(42)]
        for sock in slow[:40]:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        body = json.dumps({"prompt": "KING:", "max_tokens": 3}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        slow[40].sendall(f"{head}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        slow[40].sendall(body[:5])
        served = post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 3})
        assert served.status_code == 200
        until = time.monotonic() + 20  # a bound against a hang, far above the 1 s timeout
        slow[40].settimeout(20)
        assert slow[40].recv(65536).startswith(b"HTTP/1.1 408 ")
        assert all(closed_by_server(sock, until) for sock in slow)
        for sock in slow:
            sock.close()
        assert post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 3}).status_code == 200


def test_a_body_trickled_a_byte_at_a_time_gets_408_and_connections_past_the_cap_a_503(tiny_run):
    """A client that sends a byte of its body every quarter of a second (well within the read timeout each time)
    gets a 408 once the whole body has taken a read timeout; a connection past --max-connections gets a 503 at
    once; once those connections are gone, a request and /health are served."""
    with running(tiny_run, in_process=True, read_timeout=1.0, max_connections=3) as url:
        address = urllib.parse.urlsplit(url)[1].split(":")
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        trickling = socket.create_connection(address)
        trickling.sendall(f"{head}Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode())
        held = [socket.create_connection(address) for _ in range(2)]
        past_the_cap = socket.create_connection(address)
        past_the_cap.settimeout(20)
        assert past_the_cap.recv(65536).startswith(b"HTTP/1.1 503 ")
        answer = b""
        for _ in range(80):  # 20 s at most, far past the timeout; the whole body would take 250 s
            trickling.sendall(b" ")
            with contextlib.suppress(TimeoutError):
                trickling.settimeout(0.25)
                answer = trickling.recv(65536)
            if answer:
                break
        assert answer.startswith(b"HTTP/1.1 408 ")
        until = time.monotonic() + 20
        assert all(closed_by_server(sock, until) for sock in [trickling, *held, past_the_cap])
        for sock in [trickling, *held, past_the_cap]:
            sock.close()
        assert post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 3}).status_code == 200
        assert health(url)["status"] == "ok"


def reset_by_server(sock: socket.socket, until: float) -> bool:
    """Whether the server resets this connection before `until` (monotonic), without reading from it."""
    while time.monotonic() < until:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNRESET:
            return True
        time.sleep(0.05)
    return False


def test_a_reply_left_unread_is_dropped_after_a_read_timeout(tiny_run):
    """A client asks for a reply of megabytes (an echo with scores) and reads none of it: once none has been read
    for a read timeout, the server drops the connection and the reply it held, and serves on."""
    limits = dict(max_prompt_tokens=4096, max_echo_scores=1 << 20, max_body_bytes=1 << 16)
    with running(tiny_run, in_process=True, read_timeout=1.0, **limits) as url:
        body = json.dumps({"prompt": [5] * 4000, "n": 4, "echo": True, "logprobs": 20, "max_tokens": 0}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        unread = socket.socket()
        unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the loopback's buffers hold megabytes otherwise
        host, port = urllib.parse.urlsplit(url)[1].split(":")
        unread.connect((host, int(port)))
        unread.sendall(f"{head}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert reset_by_server(unread, time.monotonic() + 30)  # a bound against a hang, far above the timeout
        unread.close()
        assert post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 3}).status_code == 200


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


def test_session_files_past_the_cap_go_least_recently_used_first(tiny_run, tmp_path):
    def turn(url: str, name: str) -> int:
        """A turn of session `name`; its prompt tokens (a new session's count BOS, a continued one's do not)."""
        reply = post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 1, "session": name})
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]

    def saved() -> set[str]:
        return {path.name.removesuffix(SUFFIX) for path in tmp_path.glob(f"*{SUFFIX}")}

    with running(tiny_run, in_process=True, sessions_dir=tmp_path, max_session_files=3) as url:
        fresh = [turn(url, name) for name in ("s1", "s2", "s3")]
        continued = turn(url, "s1")  # s1 is now the most recently used
        assert continued == fresh[0] - 1
        turn(url, "s4")
        turn(url, "s5")
        assert saved() == {"s1", "s4", "s5"} and health(url)["session_files"] == 3
        assert turn(url, "s2") == fresh[1]  # its file was removed and it left memory: it starts anew
        assert saved() == {"s4", "s5", "s2"}
    # restarted: order by file time
    with running(tiny_run, in_process=True, sessions_dir=tmp_path, max_session_files=2) as url:
        assert health(url)["session_files"] == 3
        turn(url, "s6")
        assert saved() == {"s2", "s6"} and health(url)["session_files"] == 2


SOAK_SECONDS = float(os.environ.get("AFTGEN_SOAK_SECONDS", "12"))
SOAK_CLIENTS = 32
SOAK_RSS_GROWTH_MB = 50  # README, "What happens when...": the bound on resident memory growth after warm-up


def resident_mb() -> float:
    """This process's resident memory and its children's (the server's HTTP side runs in it, its engine in one)."""
    return tree_memory_mb(os.getpid())[0]


async def soak_client(http: httpx.AsyncClient, url: str, index: int, until: float, tally: dict) -> None:
    """Until `until`: streams of completions and chat, a named session of its own half the time; one
    request in six ends early (the client goes away), one in six is a bad request."""
    rng = random.Random(index)
    while time.monotonic() < until:
        roll = rng.random()
        if roll < 1 / 6:
            body = rng.choice([{"prompt": 5}, {"prompt": "x", "temperature": -1}, {"messages": []}, {"frob": 1}])
            response = await http.post(f"{url}/v1/completions", json=body, headers=AUTH)
            assert response.status_code == 400 and set(response.json()["error"]) == {"message", "type", "param", "code"}
            tally["bad"] += 1
            continue
        chat = rng.random() < 0.5
        body = {"max_tokens": rng.randint(5, 60), "stream": True, "temperature": 0.9}
        body |= (
            {"messages": [{"role": "user", "content": "KING:"}]}
            if chat
            else {"prompt": rng.choice(["KING:", "NURSE:"])}
        )
        if rng.random() < 0.5:
            body["session"] = f"soak-{index}"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        leave_after = rng.randint(1, 5) if roll < 2 / 6 else None
        async with http.stream("POST", f"{url}{path}", json=body, headers=AUTH) as response:
            assert response.status_code == 200, await response.aread()
            sent = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    sent.append(line[6:])
                    if leave_after is not None and len(sent) == leave_after:
                        break
        if leave_after is not None:
            tally["left"] += 1
            continue
        assert sent[-1] == "[DONE]", sent[-3:]  # not cut short
        chunks = [json.loads(data) for data in sent[:-1]]
        assert all("error" not in chunk for chunk in chunks), chunks
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        tally["whole"] += 1


@pytest.mark.soak
def test_soak_32_streaming_clients_leave_no_stream_cut_short_and_memory_flat(tiny_run, tmp_path):
    """About 12 s (AFTGEN_SOAK_SECONDS) of 32 clients on 127.0.0.1: streams run to [DONE], resident
    memory after warm-up grows by at most SOAK_RSS_GROWTH_MB, and every session file loads."""
    tally = {"whole": 0, "left": 0, "bad": 0}

    async def clients(url: str, seconds: float) -> None:
        limits = httpx.Limits(max_connections=SOAK_CLIENTS)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            until = time.monotonic() + seconds
            await asyncio.gather(*(soak_client(http, url, i, until, tally) for i in range(SOAK_CLIENTS)))

    with running(tiny_run, sessions_dir=tmp_path, parallel=SOAK_CLIENTS, queue=SOAK_CLIENTS) as url:
        asyncio.run(clients(url, min(5.0, SOAK_SECONDS / 4)))  # warm-up: buffers, caches and sessions fill
        before = resident_mb()
        asyncio.run(clients(url, SOAK_SECONDS))
        wait_for(lambda: health(url)["slots_busy"] == 0)
        growth = resident_mb() - before
    print(f"soak: {tally}, resident memory {before:.0f} MB + {growth:.1f} MB")
    assert tally["whole"] > SOAK_CLIENTS and tally["left"] and tally["bad"]
    assert growth <= SOAK_RSS_GROWTH_MB
    model, tokenizer = load(tiny_run)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == SOAK_CLIENTS
    for path in files:
        load_state(path, model, tokenizer)


BAD_SESSION_NAMES = ["../etc", "..", ".hidden", "", "a/b", "a\\b", "/abs", "a b", "x" * 65, "café", "a\x00b", "-x", 5]


def test_session_names_that_could_leave_their_folder_are_refused(tiny_run, tmp_path):
    """Each bad name is a 400 naming 'session' and writes nothing anywhere; a good one with dots and dashes works."""
    with running(tiny_run, in_process=True, sessions_dir=tmp_path / "sessions") as url:
        for name in BAD_SESSION_NAMES:
            body = {"prompt": "x", "max_tokens": 1, "session": name}
            assert_openai_error(post(url, "/v1/completions", json=body), 400, "session")
        reply = post(url, "/v1/completions", json={"prompt": "x", "max_tokens": 1, "session": "a.b-c_1"})
        assert reply.status_code == 200, reply.text
    assert [path.name for path in tmp_path.rglob("*") if path.is_file()] == [f"a.b-c_1{SUFFIX}"]


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


def test_serve_refuses_a_sessions_dir_that_holds_a_model(tiny_run, never_serve):
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_run), "--sessions-dir", str(tiny_run)])
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1
    assert result.output.startswith("error: --sessions-dir") and "holds a model" in result.output


def test_the_session_store_counts_and_removes_its_own_files_only(tiny_run, tmp_path):
    """Past max_files the oldest session's file goes, and nothing else in the folder, now or after a restart."""
    model, tokenizer = load(tiny_run)
    foreign = {"weights.safetensors": b"w", "old.safetensors": b"o", "notes.txt": b"n", f".hidden{SUFFIX}": b"h"}
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    store = SessionStore(model, tokenizer, tmp_path, limit=4, max_files=1)
    assert not store.on_disk
    for name in ("a", "b"):
        store.put(name, read_prompt(model, tokenizer, "KING:"))
    assert {name: (tmp_path / name).read_bytes() for name in foreign} == foreign
    assert sorted(path.name for path in tmp_path.glob(f"[!.]*{SUFFIX}")) == [f"b{SUFFIX}"]
    assert list(SessionStore(model, tokenizer, tmp_path, limit=4, max_files=1).on_disk) == ["b"]


def test_a_file_being_written_is_not_removed_for_the_cap(tiny_run, tmp_path):
    """A session whose file is being written (busy) keeps it past max_files; the next write past the cap takes it."""
    model, tokenizer = load(tiny_run)
    store = SessionStore(model, tokenizer, tmp_path, limit=4, max_files=1)
    context = read_prompt(model, tokenizer, "KING:")
    store.put("a", context)
    store.write("b", context)
    store.keep("b", context, busy={"a"})
    assert sorted(store.on_disk) == ["a", "b"] and (tmp_path / f"a{SUFFIX}").exists()
    store.keep("a", context)
    assert list(store.on_disk) == ["a"] and not (tmp_path / f"b{SUFFIX}").exists()


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


def test_a_damaged_session_is_named_without_the_servers_folder(tiny_run, tmp_path):
    (tmp_path / f"broken{SUFFIX}").write_bytes(b"not a state file")
    with running(tiny_run, in_process=True, sessions_dir=tmp_path) as url:
        body = {"prompt": "x", "max_tokens": 1, "session": "broken"}
        error = assert_openai_error(post(url, "/v1/completions", json=body), 400)
    assert "'broken'" in error["message"] and str(tmp_path) not in error["message"]


def test_extreme_sampling_settings_stop_no_other_stream(url):
    """Issue 36's reproduction, while a stream and a session's streamed turn run: a repeat penalty of 1e-300
    is a 400 naming it, a temperature of 1e-39 with a penalty samples, and one of 1e-300 or 5e-324 is
    greedy; the stream and the session's turn go on with no error event."""
    greedy = post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 8, "temperature": 0}).json()
    with httpx.Client(timeout=60) as http:
        assert post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 3, "session": "mid"}).is_success
        others = [Stream(http, url, "QUEEN:", LONG), Stream(http, url, " and", LONG, session="mid")]
        for other in others:
            other.texts(1)
        body = {"prompt": "x", "max_tokens": 3, "repeat_penalty": 1e-300}
        refused = assert_openai_error(post(url, "/v1/completions", json=body), 400, "repeat_penalty")
        assert "[0.0001, 100]" in refused["message"]
        body = {"prompt": "x", "max_tokens": 3, "temperature": 1e-39, "repeat_penalty": 1.1}
        assert post(url, "/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
        for temperature in (1e-300, 5e-324):
            body = {"prompt": "KING:", "max_tokens": 8, "temperature": temperature}
            assert post(url, "/v1/completions", json=body).json()["choices"] == greedy["choices"]
        for other in others:
            assert len(other.texts(20)) == 20  # texts() reads choices: an error event would fail here
            other.close()


def test_a_step_that_cannot_be_compiled_runs_eagerly_with_one_line_on_stderr(tiny_run, monkeypatch, capsys):
    model, _ = load(tiny_run, device=DEVICE)
    note = "eager (compiling the step failed: RuntimeError: no C++ compiler)"

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr("aftgen.compiled.step._compiled_step", no_compiler)
    step = CompiledBatchStep(model, 4, resolve(DEVICE, "fp32"))
    assert step.step == model.step
    said = "the compiled step cannot be used here (RuntimeError: no C++ compiler): the eager step runs"
    assert capsys.readouterr().err.splitlines() == [f"warning: {said}"]
    assert step.figures() == {"step": "eager", "batch_invariant": False, "step_note": note}


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


def test_ctrl_c_stops_aftgen_serve_saying_only_that(tiny_run):
    """As a user runs it: its address on stderr, a reply, Ctrl-C, and an exit that says it was interrupted and
    nothing more (no traceback, nothing left over at exit for a library to report)."""
    command = [sys.executable, "-m", "aftgen", "serve", "--model", str(tiny_run), "--port", "0", "--no-compile"]
    as_at_a_terminal = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)  # not a background job's
    server = subprocess.Popen(
        command, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, preexec_fn=as_at_a_terminal
    )
    try:
        started = server.stderr.readline()
        address = re.search(r"at (http://\S+)/v1", started)
        assert address, started
        reply = httpx.post(f"{address[1]}/v1/completions", json={"prompt": "KING:", "max_tokens": 5}, timeout=60)
        assert reply.status_code == 200
        server.send_signal(signal.SIGINT)
        _, rest = server.communicate(timeout=60)
    finally:
        server.kill()
    assert server.returncode == 130 and rest == "interrupted\n", rest
