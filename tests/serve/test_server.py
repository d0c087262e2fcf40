"""aftgen.serve.server: `aftgen serve` as a user runs it."""

from __future__ import annotations

import functools
import re
import signal
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


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
