"""aftgen.serve.protocol: connections that a client cannot hold open by sending or reading slowly, and no more
of them than the cap."""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import time
import urllib.parse

import pytest
from serving import KEY, health, post, running

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


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
