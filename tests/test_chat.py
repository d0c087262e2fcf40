"""`aftgen chat`: each turn reads only its new line, Ctrl-C stops a reply and Ctrl-D exits."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import DEVICE

from aftgen.api import load
from aftgen.generation.controls import SamplingOptions


@pytest.fixture(scope="module")
def tiny(tiny_run):
    return load(tiny_run, device=DEVICE)


def test_chat_never_rereads_history(tiny, monkeypatch, capsys):
    from aftgen.chat import run_chat

    model, tokenizer = tiny
    read_lengths = []
    prefill = model.prefill
    monkeypatch.setattr(
        model, "prefill", lambda ids, state=None, **kw: read_lengths.append(ids.shape[1]) or prefill(ids, state, **kw)
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO("KING:\nQUEEN: speak\nNURSE:\n"))
    context = run_chat(model, tokenizer, SamplingOptions(max_new_tokens=15, seed=0), None, None)
    replies = capsys.readouterr().out
    assert replies.count("\n") >= 3
    turns = [len(tokenizer.encode(line + "\n")) for line in ("KING:", "QUEEN: speak", "NURSE:")]
    assert read_lengths == [turns[0] + 1, turns[1], turns[2]]  # only each new line (plus BOS at the start)
    assert int(context.state[0]["position"]) == sum(turns) + 1 + 3 * 15


def _read_into(stream, sink: list[bytes]) -> None:
    for chunk in iter(lambda: stream.read1(4096), b""):
        sink.append(chunk)


def test_chat_ctrl_c_stops_the_reply_and_ctrl_d_exits(tiny_run):
    chat = subprocess.Popen(
        [sys.executable, "-m", "aftgen", "chat", "--model", str(tiny_run), "--device", DEVICE,
         "-n", "-1", "--stop", "NEVER-STOP-7"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = [], []
    readers = [
        threading.Thread(target=_read_into, args=(s, sink), daemon=True)
        for s, sink in ((chat.stdout, out), (chat.stderr, err))
    ]
    for reader in readers:
        reader.start()

    def wait_for(condition, timeout=60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert chat.poll() is None and time.monotonic() < deadline, b"".join(err).decode()
            time.sleep(0.05)

    try:
        for turn, line in enumerate((b"KING:\n", b"QUEEN:\n")):
            chat.stdin.write(line)
            chat.stdin.flush()
            seen = len(b"".join(out))
            wait_for(lambda seen=seen: len(b"".join(out)) > seen + 20)  # the reply streams, with no end of its own
            chat.send_signal(signal.SIGINT)
            wait_for(lambda turn=turn: b"".join(err).count(b"[stopped]") == turn + 1)
        chat.stdin.close()  # Ctrl-D
        assert chat.wait(timeout=60) == 0, b"".join(err).decode()
    finally:
        chat.kill()
    assert b"".join(out).decode("utf-8").strip()
