"""aftgen.serve.server: `aftgen serve` as a user runs it, the socket it listens on, its connection cap and the
name it gives the model."""

from __future__ import annotations

import functools
import re
import resource
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from aftgen.errors import AftgenError
from aftgen.serve import server
from aftgen.serve.options import MAX_CONNECTIONS

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


def test_a_port_already_taken_is_one_error_naming_it():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(AftgenError, match=f"cannot listen on 127.0.0.1:{port}: "):
            server.listening_socket("127.0.0.1", port)
    with server.listening_socket("::1" if socket.has_ipv6 else "127.0.0.1", 0) as free:
        assert free.getsockname()[1] > 0


def test_the_connection_cap_leaves_descriptors_for_the_process_and_a_burst(monkeypatch):
    assert server.connection_cap(7) == 7  # --max-connections as given
    for soft, cap in ((4096, 4096 - 192), (100, 1), (resource.RLIM_INFINITY, MAX_CONNECTIONS.high)):
        monkeypatch.setattr(resource, "getrlimit", lambda kind, soft=soft: (soft, resource.RLIM_INFINITY))
        assert server.connection_cap(None) == cap


def test_the_model_is_named_by_its_folder_or_as_given(tmp_path):
    (tmp_path / "my-model").mkdir()
    assert server.model_name(str(tmp_path / "my-model")) == "my-model"
    assert server.model_name("someone/aft-model") == "someone/aft-model"  # a Hub id
