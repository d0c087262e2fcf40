"""Issue 56's check of a default `aftgen serve`: one text alone, again, in n: 2 and among 8 others.

    python scripts/same_text_check.py [--model FOLDER]

Starts a default server (no options but a port and a key) on an empty cache of its own, and from the first moment
`/health` admits requests sends a greedy and a seeded completion: alone twice, as both choices of `n: 2`, and while
eight other streams generate. Then `aftgen sample --compile` with the same seed and temperature, on the same cache.
Prints what `/health` says of the step and whether every text matched; exits 1 if any did not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from aftgen.bench.options import BenchServeOptions
from aftgen.bench.serve import ServerProcess

PROMPT = "ROMEO:"
ASKS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 5}}
KEY = "same-text-check"
TOKENS = 60


def call(url: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    request = urllib.request.Request(url + path, json.dumps(body).encode() if body is not None else None, headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, {}


def completions(url: str, ask: dict, n: int = 1) -> list[str]:
    status, reply = call(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": TOKENS, "n": n} | ask)
    if status != 200:
        raise SystemExit(f"a completion got {status}")
    return [choice["text"] for choice in reply["choices"]]


def others(url: str, stop: threading.Event) -> list[threading.Thread]:
    """Eight streams of other prompts and temperatures, asked again until `stop` is set."""

    def loop(index: int) -> None:
        while not stop.is_set():
            call(url, "/v1/completions", {"prompt": "JULIET: " * (index + 1), "max_tokens": 200,
                                          "temperature": 0.5 * (index % 3), "seed": index})  # fmt: skip

    threads = [threading.Thread(target=loop, args=(index,), daemon=True) for index in range(8)]
    for thread in threads:
        thread.start()
    return threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="aftgen-same-text-")
    env = os.environ | {"AFTGEN_CACHE": cache, "AFTGEN_API_KEY": KEY}
    started = time.monotonic()
    with ServerProcess(BenchServeOptions(model=args.model), env=env) as server:
        url = f"http://{server.host}:{server.port}"
        while call(url, "/health")[0] != 200:
            time.sleep(0.2)
        health = call(url, "/health")[1]
        step = {name: health.get(name) for name in ("step", "batch_invariant", "batch_invariant_note")}
        print(f"admitted after {time.monotonic() - started:.1f} s; /health: {step}")
        # n: 2's first choice is the request's own seed's; the second draws on
        texts = {name: completions(url, ask) + completions(url, ask) + completions(url, ask, n=2)[:1]
                 for name, ask in ASKS.items()}  # fmt: skip
        stop = threading.Event()
        threads = others(url, stop)
        time.sleep(2)
        for name, ask in ASKS.items():
            texts[name] += completions(url, ask)
        stop.set()
        for thread in threads:
            thread.join()
    command = [sys.executable, "-m", "aftgen", "sample", "-p", PROMPT, "-n", str(TOKENS), "--no-echo", "--compile",
               "--seed", "5", "--temperature", "0.8"] + (["--model", args.model] if args.model else [])  # fmt: skip
    sampled = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout.removesuffix("\n")
    same = True
    for name, found in texts.items():
        alike = len(set(found)) == 1
        same &= alike
        print(f"{name}: alone, again, n: 2's first, among 8 others: {'all the same' if alike else 'DIFFERENT'}")
    alike = sampled == texts["seeded"][0]
    same &= alike
    print(f"aftgen sample --compile --seed 5 --temperature 0.8: {'the same' if alike else 'DIFFERENT'}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
