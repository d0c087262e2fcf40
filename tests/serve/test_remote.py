"""aftgen.serve.remote, the engine's process, supervised: the HTTP side never waits on it, /health tells whether it
answers, a dead one is reaped and started again, a client that leaves takes its request with it from both
processes, and a message it cannot read is refused in one line while it goes on serving.

One server for the module (its engine a process of its own, as `aftgen serve` runs it), with prompts as long
as the audit's (about 8,000 tokens); one `aftgen serve` run as a command, for the exit after too many restarts.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import email.utils
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from conftest import make_corpus
from serving import (
    AUTH,
    KEY,
    LONG,
    Stream,
    assert_openai_error,
    engine_processes,
    post,
    server_options,
    serving,
    wait_for,
)

from aftgen.bench.measure import tree_memory_mb
from aftgen.checkpoint import TOKENIZER
from aftgen.generation.controls import SamplingOptions
from aftgen.serve.remote import EngineProcess
from aftgen.serve.work import Done, Failed, Ticket, Work
from aftgen.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")

# Prompts of about 8,000 tokens, read 32 at a time so that a client can leave while its prompt is read.
SUPERVISED = dict(max_prompt_tokens=8192, max_body_bytes=1 << 20, parallel=4, queue=16, prompt_chunk=32, cache_mb=0)
CLIENTS_AT_ONCE = 20  # --parallel and --queue: every one of them is taken in


@pytest.fixture(scope="module")
def supervised(tiny_run, tmp_path_factory) -> Iterator[tuple[str, EngineProcess]]:
    """The module's server and its engine's proxy (to see its tickets and its child's PID)."""
    options = server_options(tiny_run, sessions_dir=tmp_path_factory.mktemp("sessions"), **SUPERVISED)
    engine = EngineProcess(options)
    with serving(options, engine) as url:
        yield url, engine


@pytest.fixture(scope="module")
def long_prompt(tiny_run) -> str:
    """About 7,900 tokens of the tiny model's language."""
    tokenizer = Tokenizer.load(tiny_run / TOKENIZER)
    return tokenizer.decode(tokenizer.encode(make_corpus(60_000, seed=1))[:7_900])


def health(url: str, timeout: float = 5) -> httpx.Response:
    return httpx.get(f"{url}/health", headers=AUTH, timeout=timeout)


def engine_pid() -> int:
    """The module's engine process, once there is one (a minute at most)."""
    wait_for(lambda: len(engine_processes()) == 1, tries=3000)
    return engine_processes()[0]


# The HTTP side's threads, by name: an in-process engine of an earlier test may leave threads of its own (aftgen-*)
SERVER_THREADS = ("aftgen-http", "aftgen-engine-sends", "aftgen-engine-events")


def server_tasks() -> list[Path]:
    """The server's threads in this process (uvicorn's loop, the engine's writer and reader: named aftgen-*), and
    its engine's process, as /proc folders: not the other threads here, which earlier tests may have left."""
    threads = [Path(f"/proc/self/task/{thread.native_id}") for thread in threading.enumerate()
               if thread.name in SERVER_THREADS]  # fmt: skip
    return [*threads, Path(f"/proc/{engine_pid()}")]


def cpu_seconds(tasks: list[Path]) -> float:
    """User and system time the processes or threads have used so far."""
    total = 0
    for task in tasks:
        fields = (task / "stat").read_text().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15, counted after the name
    return total / os.sysconf("SC_CLK_TCK")


def leave_during_prompt(url: str, prompt: str, clients: int = CLIENTS_AT_ONCE) -> None:
    """`clients` clients send a long prompt each, and all go away once the server has taken every one in."""
    host, port = urllib.parse.urlsplit(url).netloc.split(":")
    body = json.dumps({"prompt": prompt, "max_tokens": 1000}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    request = f"{head}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    sockets = [socket.create_connection((host, int(port))) for _ in range(clients)]
    try:
        for sock in sockets:
            sock.sendall(request)
        wait_for(lambda: sum(health(url).json()[name] for name in ("slots_busy", "queued")) == clients)
    finally:
        for sock in sockets:
            sock.close()


def settled(url: str) -> bool:
    """The engine holds no request."""
    figures = health(url).json()
    return figures["slots_busy"] == 0 and figures["queued"] == 0


def test_a_stopped_engine_leaves_health_answering_and_every_request_ends_once_it_goes_on(supervised, long_prompt):
    """kill -STOP of the engine with ten long prompts sent: the HTTP side takes them all in, /health answers 503
    within seconds, and after SIGCONT each request ends with 200 or an error in OpenAI's shape."""
    url, engine = supervised
    pid = engine_pid()
    body = {"prompt": long_prompt, "max_tokens": 4}
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        os.kill(pid, signal.SIGSTOP)
        try:
            replies = [pool.submit(post, url, "/v1/completions", json=body) for _ in range(10)]
            wait_for(lambda: len(engine.tickets) == 10)  # more than the socket to the engine holds
            began = time.monotonic()
            answers = [health(url), httpx.get(f"{url}/health", timeout=5)]  # with the key and without
            waited = time.monotonic() - began
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [answer.status_code for answer in answers] == [503, 503] and waited < 5
        assert all(answer.json() == {"status": "engine not answering"} for answer in answers)
        for reply in [future.result() for future in replies]:
            assert reply.status_code in (200, 503), reply.text
            assert reply.json()["choices" if reply.status_code == 200 else "error"]
    wait_for(lambda: health(url).status_code == 200 and settled(url))
    assert not engine.tickets


def test_a_killed_engine_is_reaped_and_started_again_with_its_sessions(supervised):
    """kill -9 of the engine: its stream ends with an error event, requests meanwhile get a 503 with
    Retry-After and /health a 503, the old process is no zombie, and the new one serves, sessions included."""
    url, engine = supervised
    session = {"prompt": "KING:", "max_tokens": 3, "session": "kept"}
    assert post(url, "/v1/completions", json=session).status_code == 200
    old = engine_pid()
    with httpx.Client(timeout=60) as http:
        stream = Stream(http, url, "KING:", LONG)
        stream.texts(1)
        os.kill(old, signal.SIGKILL)
        rest = [line for line in stream.lines if line.startswith("data: ")]
    assert json.loads(rest[-2][6:])["error"]["type"] == "server_error" and rest[-1] == "data: [DONE]"
    refused = post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 4})
    assert assert_openai_error(refused, 503)["code"] == "engine_restarting" and int(refused.headers["retry-after"]) >= 1
    assert health(url).json() == {"status": "engine restarting"}
    wait_for(lambda: health(url).status_code == 200, tries=3000)
    assert not Path(f"/proc/{old}").exists()  # reaped: a zombie keeps its entry
    assert engine_pid() != old
    assert post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 4}).status_code == 200
    assert post(url, "/v1/completions", json=session | {"prompt": " more"}).status_code == 200


def test_clients_that_leave_during_their_prompt_leave_nothing_in_either_process(supervised, long_prompt):
    """200 clients leave while their 8,000-token prompts wait or are read: no request stays in the HTTP side's
    table or the engine's, and the processes' resident memory stays flat."""
    url, engine = supervised
    leave_during_prompt(url, long_prompt)  # warm-up: buffers and the allocator's arenas fill
    wait_for(lambda: settled(url))
    before = tree_memory_mb(os.getpid())[0]
    for _ in range(9):
        leave_during_prompt(url, long_prompt)
        wait_for(lambda: settled(url))
    growth = tree_memory_mb(os.getpid())[0] - before
    print(f"resident memory {before:.0f} MB + {growth:.1f} MB after {9 * CLIENTS_AT_ONCE} clients left")
    assert not engine.tickets and growth < 30


def test_an_idle_server_uses_no_cpu_after_clients_left(supervised, long_prompt):
    """Once the last client has gone, the server sleeps, its HTTP side and its engine's process: under 1% of a
    core over 5 s (the clock ticks 10 ms: a shorter look would count a tick or two of housekeeping as a share)."""
    url, _ = supervised
    leave_during_prompt(url, long_prompt)
    wait_for(lambda: settled(url))
    tasks = server_tasks()
    assert len(tasks) == 4  # uvicorn's loop, the writer, the reader and the engine
    before = cpu_seconds(tasks)
    time.sleep(5)
    used = cpu_seconds(tasks) - before
    print(f"{used:.2f} s of CPU in 5 s idle")
    assert used < 0.05


def test_a_server_that_sleeps_while_idle_still_dates_its_replies(supervised):
    """The server loop sleeps while idle (QuietServer), yet each reply's Date is the second it was asked in."""
    url, _ = supervised
    dates = []
    for _ in range(2):
        dates.append(email.utils.parsedate_to_datetime(health(url).headers["date"]))
        time.sleep(2.2)
    assert dates[1] - dates[0] >= datetime.timedelta(seconds=2)
    assert abs(datetime.datetime.now(datetime.timezone.utc) - dates[1]) < datetime.timedelta(seconds=5)


def test_an_engine_that_keeps_dying_makes_the_server_exit_for_its_supervisor(tiny_run):
    """Past RESTARTS_PER_MINUTE (here 1) the server stops serving and exits 2 with one line saying why."""
    capped = "import aftgen.serve.remote as r; r.RESTARTS_PER_MINUTE = 1; from aftgen.cli import run; run()"
    command = [sys.executable, "-c", capped, "serve", "--model", str(tiny_run), "--port", "0", "--no-compile"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)

    def child() -> int:
        wait_for(lambda: Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().strip(), tries=3000)
        return int(Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()[0])

    try:
        address = re.search(r"at (http://\S+)/v1", server.stderr.readline())
        assert address
        first = child()
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{address[1]}/health", timeout=5).status_code == 200, tries=3000)
        os.kill(child(), signal.SIGKILL)
        _, rest = server.communicate(timeout=60)
    finally:
        server.kill()
    assert server.returncode == 2, rest
    assert rest.strip().splitlines()[-1].startswith("error: the generation process ended 2 times within a minute")


def test_a_stopped_engine_keeps_no_request_past_the_servers_timeout(tiny_run):
    """--timeout 5 and the engine stopped (kill -STOP): a stream begun before and a request sent then each end
    with the 504 of a request past its time, kept by the HTTP side, and the engine serves again after SIGCONT."""
    options = server_options(tiny_run, timeout=5.0)
    engine = EngineProcess(options)
    with serving(options, engine) as url, httpx.Client(timeout=30) as http:
        stream = Stream(http, url, "KING:", LONG)
        stream.texts(1)
        pid = engine.child.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            whole = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "KING:"}, timeout=30)
            streamed = [line for line in stream.lines if line.startswith("data: ")]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert "longer than this server's limit of 5 s" in assert_openai_error(whole, 504)["message"]
        assert json.loads(streamed[-2][6:])["error"]["message"] == assert_openai_error(whole, 504)["message"]
        assert streamed[-1] == "data: [DONE]"
        wait_for(lambda: not engine.tickets)
        assert post(url, "/v1/completions", json={"prompt": "KING:", "max_tokens": 4}).status_code == 200


def test_a_stop_sent_to_the_whole_group_never_restarts_the_engine(tiny_run):
    """SIGTERM to the server's process group (systemd's stop, kill -TERM -PGID) reaches its engine too: the server
    stops, the engine with it, and no line says the engine is started again."""
    command = [sys.executable, "-m", "aftgen", "serve", "--model", str(tiny_run), "--port", "0", "--no-compile"]
    server = subprocess.Popen(
        command, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True
    )
    try:
        address = re.search(r"at (http://\S+)/v1", server.stderr.readline())
        assert address
        reply = httpx.post(f"{address[1]}/v1/completions", json={"prompt": "KING:", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200
        os.killpg(server.pid, signal.SIGTERM)
        _, rest = server.communicate(timeout=60)
    finally:
        server.kill()
    assert server.returncode == -signal.SIGTERM and "again" not in rest, rest  # uvicorn raises it again once shut down
    wait_for(lambda: not group_alive(server.pid))


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_message_the_engine_cannot_read_is_refused_in_one_line_and_it_goes_on_serving(tiny_run, capfd):
    """Messages of another version (a submit whose work is not one, a kind it does not know): each is one line on
    the engine's stderr, a submit's request fails at once naming what is wrong, and the next request is served."""
    engine = EngineProcess(server_options(tiny_run))
    events: list = []
    engine.publish = events.extend
    engine.start()
    broken = engine.tickets[7] = Ticket(Work([], SamplingOptions()), time.monotonic() + 60, 7)
    try:
        engine.child.post(msgspec.Raw(msgspec.msgpack.encode({"type": "Submit", "number": 7, "work": {"prompt": "x"}})))
        engine.child.post(msgspec.Raw(msgspec.msgpack.encode({"type": "Resume", "number": 8})))
        served = engine.submit(Work(engine.tokenizer.encode("KING:"), SamplingOptions(max_new_tokens=3)), 9)
        wait_for(lambda: any(ticket is served and isinstance(event, Done) for ticket, event in list(events)))
    finally:
        engine.stop()
    assert [event for ticket, event in events if ticket is broken] == [
        Failed(500, "the generation process cannot read this request: Expected `array`, got `str` - at `$.work.prompt`")
    ]
    logged = capfd.readouterr().err
    refusals = [line for line in logged.splitlines() if "cannot read a message sent to it" in line]
    assert len(refusals) == 2 and "Traceback" not in logged, logged
    assert "Invalid value 'Resume' - at `$.type`" in refusals[1]
