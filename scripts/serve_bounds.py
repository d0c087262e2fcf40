"""What clients can make `aftgen serve` hold (issue 56's bars for items 7 and 8), against the shipped model on
127.0.0.1, its step eager (--no-compile: what is measured is the HTTP side):

1. echo: four clients send 8,191 token ids with `echo`, `logprobs: 20` and `n: 32` and never read; then four
   with `n: 1` (which --max-echo-scores serves: megabytes each). Throughout, the server's process tree's growth
   and /health's slowest answer, every half second; first as long with no clients, for what it grows by alone.
2. slow: 1,100 connections send full headers, then a byte of their body every 4 s, into a server under
   `ulimit -n 1024`; after 15 s a request and /health.

    .venv/bin/python scripts/serve_bounds.py [echo|slow ...] [--seconds 20]

It measures whichever aftgen Python imports (PYTHONPATH picks a checkout).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from aftgen.bench.measure import tree_memory_mb

HOST = "127.0.0.1"
ECHO_IDS = [100 + i % 800 for i in range(8191)]
SLOW_CLIENTS, SLOW_DESCRIPTORS, TRICKLE_EVERY, SLOW_CHECK_AT = 1100, 1024, 4.0, 15.0
START_TIMEOUT = 300.0


class Server:
    """`aftgen serve` on a free loopback port, its descriptors limited to `descriptors` (None: as inherited)."""

    def __init__(self, descriptors: int | None = None):
        command = [sys.executable, "-m", "aftgen", "serve", "--port", "0", "--no-compile"]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve-bounds-", suffix=".log")

        def limited() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, descriptors))

        limit = limited if descriptors else None
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stderr=self.log, preexec_fn=limit)
        self.port = self._port()

    def _port(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and self.process.poll() is None:
            found = re.search(r"at http://[\d.]+:(\d+)/v1", self.said())
            if found:
                return int(found.group(1))
            time.sleep(0.2)
        self.close()
        raise SystemExit(f"the server did not start: {self.said()[-500:]}")

    def said(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def request_bytes(path: str, body: bytes, length: int | None = None) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(body) if length is None else length}\r\n\r\n".encode() + body


def never_reading(port: int, body: dict) -> socket.socket:
    """A client that sends its request and reads nothing (its receive buffer kept small, as a far one's is full)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((HOST, port))
    sock.sendall(request_bytes("/v1/completions", json.dumps(body).encode()))
    return sock


def first_line(sock: socket.socket, timeout: float) -> str:
    """The status line the server sent this client, or what happened instead."""
    sock.settimeout(timeout)
    try:
        data = sock.recv(64)
    except TimeoutError:
        return "nothing"
    except ConnectionResetError:
        return "reset"
    return data.split(b"\r\n")[0].decode(errors="replace") if data else "closed"


def timed(call) -> tuple[str, float]:
    began = time.monotonic()
    try:
        status = str(call().status_code)
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return status, time.monotonic() - began


def echo(seconds: float) -> None:
    server = Server()
    url = f"http://{HOST}:{server.port}"
    try:
        for n in (0, 32, 1):  # 0: no clients, what the server grows by on its own
            before = tree_memory_mb(server.process.pid)[0]
            body = {"prompt": ECHO_IDS, "echo": True, "logprobs": 20, "n": n, "max_tokens": 0}
            clients = [never_reading(server.port, body) for _ in range(4 if n else 0)]
            grew, slowest, statuses = 0.0, 0.0, set()
            for _ in range(int(seconds / 0.5)):
                status, took = timed(lambda: httpx.get(f"{url}/health", timeout=5))
                statuses.add(status)
                slowest = max(slowest, took)
                grew = max(grew, tree_memory_mb(server.process.pid)[0] - before)
                time.sleep(0.5)
            answers = sorted({first_line(sock, 1.0) for sock in clients})
            for sock in clients:
                sock.close()
            print(
                f"echo n={n}: {len(clients)} clients never reading for {seconds:g} s: tree grew {grew:.0f} MB at "
                f"most (from {before:.0f}); /health {sorted(statuses)}, slowest {slowest:.2f} s; clients got {answers}"
            )
    finally:
        server.close()


def slow(seconds: float) -> None:
    server = Server(SLOW_DESCRIPTORS)
    url = f"http://{HOST}:{server.port}"
    head = request_bytes("/v1/completions", b"", length=100_000)
    began, clients, refused = time.monotonic(), [], 0
    try:
        for _ in range(SLOW_CLIENTS):
            try:
                sock = socket.create_connection((HOST, server.port), timeout=1)
                sock.sendall(head)
                sock.setblocking(False)
                clients.append(sock)
            except OSError:
                refused += 1
        print(
            f"slow: {len(clients)} of {SLOW_CLIENTS} connected in {time.monotonic() - began:.1f} s "
            f"({refused} not), server under ulimit -n {SLOW_DESCRIPTORS}"
        )
        while time.monotonic() - began < SLOW_CHECK_AT:
            for sock in clients:
                try:
                    sock.send(b" ")
                except OSError:  # closed by the server: it stays closed
                    pass
            time.sleep(min(TRICKLE_EVERY, max(0.0, SLOW_CHECK_AT - (time.monotonic() - began))))
        payload = {"prompt": "KING:", "max_tokens": 3}
        request = timed(lambda: httpx.post(f"{url}/v1/completions", json=payload, timeout=10))
        health = timed(lambda: httpx.get(f"{url}/health", timeout=10))
        answers: dict[str, int] = {}
        for sock in clients:
            line = first_line(sock, 0.01)
            answers[line] = answers.get(line, 0) + 1
            sock.close()
        errors = server.said().count("out of system resource")
        print(
            f"slow: after {SLOW_CHECK_AT:g} s a request: {request[0]} in {request[1]:.2f} s, /health: {health[0]} "
            f"in {health[1]:.2f} s; slow clients got {answers}; 'out of system resource' logged {errors} times"
        )
    finally:
        for sock in clients:
            sock.close()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checks", nargs="*", help="echo, slow or both (default: both).")
    parser.add_argument("--seconds", type=float, default=20.0, help="How long the echo's clients stay (default 20).")
    given = parser.parse_args()
    checks = {"echo": echo, "slow": slow}
    if set(given.checks) - set(checks):
        parser.error(f"checks are {' and '.join(checks)}, not {' '.join(sorted(set(given.checks) - set(checks)))}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * SLOW_CLIENTS)), hard))  # this side's sockets
    for check in given.checks or list(checks):
        checks[check](given.seconds)


if __name__ == "__main__":
    main()
