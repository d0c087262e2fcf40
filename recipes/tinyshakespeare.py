"""Get Tiny Shakespeare for `make default-model`, as nanoGPT's data/shakespeare_char/prepare.py does.

    python recipes/tinyshakespeare.py PATH [--url URL] [--sha256 HEX]

A file already at PATH is used as it is (`make default-model SHAKESPEARE=my/copy.txt`). Otherwise the
corpus is downloaded from char-rnn's repository (or $SHAKESPEARE_URL), its SHA-256 checked, and
written to PATH atomically.
Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"  # 1,115,394 bytes


def fetch(path: Path, url: str, sha256: str) -> None:
    """Download `url` to `path` if nothing is there; raise SystemExit with one line on any failure."""
    if path.is_file():
        print(f"using {path}", file=sys.stderr)
        return
    hint = f"download it yourself and run: make default-model SHAKESPEARE=path/to/input.txt ({url})"
    print(f"downloading {url} -> {path}", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise SystemExit(f"error: cannot download Tiny Shakespeare ({getattr(exc, 'reason', exc)}); {hint}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise SystemExit(f"error: {url} gave {len(data):,} bytes with SHA-256 {digest}, not {sha256}; {hint}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(temporary, path)
    print(f"wrote {path} ({len(data):,} bytes, SHA-256 checked)", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description="Get Tiny Shakespeare for make default-model.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--url", default=os.environ.get("SHAKESPEARE_URL") or URL)
    parser.add_argument("--sha256", default=SHA256)
    args = parser.parse_args()
    fetch(args.path, args.url, args.sha256)


if __name__ == "__main__":
    main()
