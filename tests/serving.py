"""What the server tests share: a server run in a thread of the test process, and the clients that talk to it;
what `aftgen sample` gives, to compare with; a step whose compile ends when a test says."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
from conftest import DEVICE

from aftgen.api import load
from aftgen.device import resolve
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.loop import generate
from aftgen.generation.prompt import read_prompt
from aftgen.model import AFTLM
from aftgen.serve import batch as batch_module
from aftgen.serve.engine import Engine
from aftgen.serve.options import ServeOptions
from aftgen.serve.remote import EngineProcess
from aftgen.serve.server import prepare

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = 20_000  # tokens: a stream that outlasts anything a test waits for (it is closed before the end)
LIMITS = dict(max_tokens=LONG, max_prompt_tokens=300, max_body_bytes=4096, parallel=16, queue=4)
PERSON = {  # the issue's: a string of at most 20 characters, an integer and an enum
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["friend", "foe", "stranger"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}


def library_text(model_dir, prompt: str, **options) -> str:
    """What `aftgen sample` prints for the same prompt and options (without the echoed prompt)."""
    model, tokenizer = load(model_dir, device=DEVICE)
    context = read_prompt(model, tokenizer, prompt, seed=options.get("seed"))
    return "".join(generate(model, tokenizer, context, SamplingOptions(**options)))


def server_options(model_dir, **changes) -> ServeOptions:
    """The tests' server options for `model_dir`. Its step is eager: a compile (tens of seconds) is tested
    once, by bench serve's server."""
    base = dict(model=str(model_dir), port=0, api_key=KEY, cache_mb=16, compile_step=False, device=DEVICE, dtype="fp32")
    return ServeOptions(**base | LIMITS | changes)


@contextlib.contextmanager
def running(model_dir, in_process: bool = False, **changes) -> Iterator[str]:
    """A server for `model_dir` on a free loopback port, its engine in a process of its own as `aftgen serve`
    runs it (in_process: in this one, where a test changes the engine); yields its base URL."""
    options = server_options(model_dir, **changes)
    engine = Engine(*load(model_dir, DEVICE), options, resolve(DEVICE, "fp32")) if in_process else None
    with serving(options, engine) as url:
        yield url


@contextlib.contextmanager
def watched(model_dir) -> Iterator[str]:
    """running(model_dir); when it stops, its engine's process is gone too (where /proc tells)."""
    tracked = Path("/proc/self/task").exists()
    before = set(engine_processes()) if tracked else set()
    with running(model_dir) as base:
        children = set(engine_processes()) - before if tracked else set()
        yield base
    wait_for(lambda: not children & set(engine_processes() if tracked else []))


@contextlib.contextmanager
def serving(options: ServeOptions, engine: Engine | EngineProcess | None) -> Iterator[str]:
    """prepare(options, engine)'s server, run in a thread until the block ends; yields its base URL."""
    server, sock, url = prepare(options, engine)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="aftgen-http", daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started, "the server did not start"
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def post(url: str, path: str, key: str | None = KEY, headers: dict | None = None, **kwargs) -> httpx.Response:
    """A POST as a JSON client sends it (`headers` adds to or replaces the usual ones)."""
    usual = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    return httpx.post(f"{url}{path}", headers=usual | (headers or {}), timeout=60, **kwargs)


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()


def busy_slots(url: str) -> int:
    return health(url)["slots_busy"]


def wait_for(condition, tries: int = 500) -> None:
    """Poll (bounded: 10 s) until the server reaches a state; fail if it never does."""
    for _ in range(tries):
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError("the server never got there")


class Stream:
    """A streaming completion left open; read it line by line, end it with close() (the client going away)."""

    def __init__(self, http: httpx.Client, url: str, prompt: str, max_tokens: int, **fields):
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, **fields}
        headers = {"Authorization": f"Bearer {KEY}"}
        self.response = http.send(
            http.build_request("POST", f"{url}/v1/completions", json=body, headers=headers), stream=True
        )
        assert self.response.status_code == 200, self.response.read()
        self.lines = self.response.iter_lines()  # kept: dropping the iterator would close the connection

    def texts(self, count: int | None = None) -> list[str]:
        """The next `count` chunks' texts (None: all the rest)."""
        found = []
        for line in self.lines:
            if line.startswith("data: {"):
                found.append(json.loads(line[6:])["choices"][0]["text"])
                if len(found) == count:
                    break
        return found

    def close(self) -> None:
        self.response.close()


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    return error


def engine_processes() -> list[int]:
    """This process's children that run an engine (aftgen.serve.remote)."""
    pid = os.getpid()
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children if b"aftgen.serve.remote" in Path(f"/proc/{child}/cmdline").read_bytes()]


def slow_compile(monkeypatch, model: AFTLM) -> tuple[threading.Event, list[int]]:
    """Compiles that end when the returned event is set, of a step that notes each batch's rows in the list."""
    done, calls = threading.Event(), []

    def compiled(ids, state):
        calls.append(ids.shape[0])
        return model.step(ids, state)

    def compile_step(model, rows, batch_invariant):
        done.wait(30)
        return compiled, "compiled in 30 s"

    monkeypatch.setattr(batch_module, "compile_step", compile_step)
    return done, calls
