"""Peak memory of `aftgen prime` over a long text: a corpus repeated to a given size, read once into a state.

    python scripts/prime_memory.py CORPUS.txt [--megabytes 100] [--work FOLDER] [PRIME_OPTIONS...]

Writes CORPUS repeated (and cut) to `--megabytes` million bytes into `--work` (a temporary folder by default),
runs `aftgen prime` on it with the shipped model, and prints the exit status, the wall time and the peak
resident memory of the prime process (the kernel's high-water mark for the largest waited-for child, as
`/usr/bin/time -v` reports it). The aftgen run is the one this script's interpreter imports (put a tree first
on PYTHONPATH to measure it).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def repeated_text(corpus: Path, size: int, out: Path) -> None:
    piece = corpus.read_bytes()
    with out.open("wb") as sink:
        written = 0
        while written < size:
            chunk = piece[: size - written]
            sink.write(chunk)
            written += len(chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--work", type=Path, default=None)
    args, prime_options = parser.parse_known_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="aftgen-prime-"))
    text = work / f"text-{args.megabytes}mb.txt"
    if not text.exists() or text.stat().st_size != args.megabytes * 1_000_000:
        repeated_text(args.corpus, args.megabytes * 1_000_000, text)
    extra = [option for option in prime_options if option != "--"]
    command = [sys.executable, "-m", "aftgen", "prime", str(text), "--out", str(work / "state.pt"), *extra]
    print("running:", " ".join(command), flush=True)
    started = time.monotonic()
    status = subprocess.run(command, check=False).returncode
    seconds = time.monotonic() - started
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(f"exit status {status}, {seconds:,.0f} s, peak resident memory {peak_kib / 1024:,.0f} MiB", flush=True)
    sys.exit(status if status >= 0 else 128 - status)  # killed by a signal: the shell's 128 + its number


if __name__ == "__main__":
    main()
