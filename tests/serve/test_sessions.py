"""aftgen.serve.sessions: named sessions kept between requests and on disk, across restarts, within their cap,
and never written outside their folder."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from conftest import DEVICE
from serving import AUTH, LONG, Stream, assert_openai_error, health, post, running

from aftgen.api import load
from aftgen.device import resolve
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.loop import generate
from aftgen.generation.prompt import read_prompt
from aftgen.model import tokens_read
from aftgen.serve import sessions as sessions_module
from aftgen.serve.engine import Engine
from aftgen.serve.options import ServeOptions
from aftgen.serve.sessions import SUFFIX, SessionStore
from aftgen.serve.work import Done, Failed, Started, Ticket, Work
from aftgen.state import load_state

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


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


def events(url: str, path: str = "/v1/completions", **body) -> list[str]:
    """Every server-sent event's data of one streaming request, to its end."""
    with httpx.stream("POST", f"{url}{path}", json=body | {"stream": True}, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_a_session_that_cannot_be_saved_fails_its_own_request_alone(tiny_run, tmp_path):
    """A folder where the session's file goes: its stream ends with an error event and [DONE], a whole
    request gets a 500 naming its file (not the server's folder), an unrelated stream goes on untouched,
    and the session stays as it was before those turns (a twin that never had them ends in the same state)."""
    turn = dict(max_tokens=6, temperature=0)
    with running(tiny_run, in_process=True, sessions_dir=tmp_path) as url, httpx.Client(timeout=60) as http:
        for name in ("dave", "erin"):
            assert post(url, "/v1/completions", json={"prompt": "KING:", "session": name} | turn).status_code == 200
        other = Stream(http, url, "QUEEN:", LONG)
        other.texts(1)
        blocked = tmp_path / f"dave{SUFFIX}"
        blocked.unlink()
        blocked.mkdir()
        streamed = events(url, prompt=" and", session="dave", **turn)
        assert streamed[-1] == "[DONE]"
        error = json.loads(streamed[-2])["error"]
        assert error["type"] == "server_error" and "'dave'" in error["message"] and blocked.name in error["message"]
        whole = assert_openai_error(post(url, "/v1/completions", json={"prompt": " so", "session": "dave"} | turn), 500)
        assert "'dave'" in whole["message"] and blocked.name in whole["message"]
        assert str(tmp_path) not in error["message"] + whole["message"]
        assert len(other.texts(20)) == 20  # no error chunk (texts() reads choices) and no early end
        other.close()
        blocked.rmdir()
        then = {name: post(url, "/v1/completions", json={"prompt": " then", "session": name} | turn).json()
                for name in ("dave", "erin")}  # fmt: skip
        assert then["dave"]["choices"] == then["erin"]["choices"]
    model, tokenizer = load(tiny_run)
    dave, erin = (load_state(tmp_path / f"{name}{SUFFIX}", model, tokenizer) for name in ("dave", "erin"))
    assert tokens_read(dave.state) == tokens_read(erin.state)
    for mine, twin in zip(dave.state, erin.state, strict=True):  # batched with another stream or not: 1e-4
        for name in mine:
            torch.testing.assert_close(mine[name], twin[name], rtol=1e-4, atol=1e-4)


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


def test_a_session_file_is_written_off_the_engines_thread(tiny_run, tmp_path, monkeypatch):
    """A session's file slow to write (a slow disk's fsync): another stream runs to its end meanwhile, the
    session's turn ends only once its file is written, and its next turn, sent meanwhile (its client may leave
    before the end), waits for it rather than finding the session busy, then continues it."""
    model, tokenizer = load(tiny_run, device=DEVICE)
    release, written = threading.Event(), threading.Event()
    save = sessions_module.save_state

    def slow_save(*args) -> None:
        release.wait(10)
        save(*args)
        written.set()

    monkeypatch.setattr(sessions_module, "save_state", slow_save)
    engine = Engine(model, tokenizer, ServeOptions(cache_mb=0, sessions_dir=tmp_path), resolve(DEVICE, "fp32"))
    events: list = []
    engine.publish = events.extend

    def done(ticket: Ticket, kinds: tuple = (Done,)) -> bool:
        return any(owner is ticket and isinstance(event, kinds) for owner, event in events)

    session = engine.submit(Work(tokenizer.encode("KING:"), SamplingOptions(max_new_tokens=2), session="s"))
    other = engine.submit(Work(tokenizer.encode("QUEEN:"), SamplingOptions(max_new_tokens=30)))
    while not done(other):
        engine.turn()
    assert not written.is_set() and not done(session)
    then = engine.submit(Work(tokenizer.encode(" and"), SamplingOptions(max_new_tokens=2), session="s"))
    engine.turn()
    release.set()
    while not done(then, (Done, Failed)):
        engine.turn()
    assert written.is_set() and done(session) and done(then) and list(engine.sessions.on_disk) == ["s"]
    started = [event for owner, event in events if owner is then and isinstance(event, Started)]
    assert [event.prompt_tokens for event in started] == [len(tokenizer.encode(" and"))]  # continued: no BOS


def test_a_damaged_session_is_named_without_the_servers_folder(tiny_run, tmp_path):
    (tmp_path / f"broken{SUFFIX}").write_bytes(b"not a state file")
    with running(tiny_run, in_process=True, sessions_dir=tmp_path) as url:
        body = {"prompt": "x", "max_tokens": 1, "session": "broken"}
        error = assert_openai_error(post(url, "/v1/completions", json=body), 400)
    assert "'broken'" in error["message"] and str(tmp_path) not in error["message"]
