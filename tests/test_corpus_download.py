"""`make default-model`'s corpus: Tiny Shakespeare downloaded (from a local server here, never the
internet) and checked, a local copy used as it is, and one line saying what to do when neither works."""

from __future__ import annotations

import hashlib
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "recipes" / "tinyshakespeare.py"
TEXT = b"First Citizen:\nBefore we proceed any further, hear me speak.\n"


@pytest.fixture
def mirror(tmp_path) -> Iterator[tuple[str, list[str]]]:
    """A web server on 127.0.0.1 serving TEXT at /input.txt; yields its URL and the paths it was asked for."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            found = self.path == "/input.txt"
            self.send_response(200 if found else 404)
            self.end_headers()
            self.wfile.write(TEXT if found else b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/input.txt", asked
    server.shutdown()
    server.server_close()


def fetch(path: Path, url: str, *options: str) -> subprocess.CompletedProcess:
    env = os.environ | {"SHAKESPEARE_URL": url}
    return subprocess.run([sys.executable, SCRIPT, path, *options], env=env, capture_output=True, text=True)


def test_the_corpus_is_downloaded_and_checked_when_missing(tmp_path, mirror):
    url, asked = mirror
    path = tmp_path / "data" / "tinyshakespeare.txt"
    done = fetch(path, url, "--sha256", hashlib.sha256(TEXT).hexdigest())
    assert done.returncode == 0, done.stderr
    assert path.read_bytes() == TEXT and asked == ["/input.txt"]
    again = fetch(path, url)  # there now: used as it is, nothing asked of the server
    assert again.returncode == 0 and asked == ["/input.txt"]


def test_a_download_that_fails_or_differs_says_in_one_line_how_to_give_the_file(tmp_path, mirror):
    url, _ = mirror
    path = tmp_path / "tinyshakespeare.txt"
    for run in (fetch(path, url), fetch(path, url.replace("input.txt", "gone.txt"))):  # wrong SHA-256; a 404
        assert run.returncode == 1
        (line,) = run.stderr.strip().splitlines()[1:]  # after "downloading URL -> PATH"
        assert line.startswith("error: ") and "make default-model SHAKESPEARE=" in line
        assert not path.exists() and not list(tmp_path.iterdir())
