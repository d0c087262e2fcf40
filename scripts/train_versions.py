"""Training steps/s of two source trees of aftgen side by side: short `aftgen train` runs of each, alternating.

    python scripts/train_versions.py BEFORE_TREE AFTER_TREE CORPUS.txt [--rounds 2] [--kilobytes 300]
        [--seconds 40] [--preset small] [TRAIN_OPTIONS...]

Cuts CORPUS to its first `--kilobytes` thousand bytes, then each round trains a fresh run from each tree in
turn (its code put first on PYTHONPATH): `aftgen train --preset small --max-time 40s` plus any other options
given. A run's figure is its steps over its training time as its training.json records them (`step`,
`elapsed`: held-out checks and saves included, the recipe's probe and the tokenizer not); the figure kept for
a tree is its best round (other processes only ever add time). Prints each round and the ratio after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def one_run(tree: Path, corpus: Path, out: Path, train_options: list[str]) -> dict:
    env = os.environ | {"PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "aftgen", "train", str(corpus), "--out", str(out), "--overwrite", "-q"]
    subprocess.run([*command, *train_options], env=env, check=True)
    info = json.loads((out / "training.json").read_text())
    return {"steps": info["step"], "seconds": info["elapsed"], "dtype": info["options"]["dtype"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kilobytes", type=int, default=300)
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--preset", default="small")
    args, extra = parser.parse_known_args()
    train_options = ["--preset", args.preset, "--max-time", f"{args.seconds}s", *extra]
    best = {"before": 0.0, "after": 0.0}
    with tempfile.TemporaryDirectory(prefix="aftgen-train-versions-") as work:
        corpus = Path(work) / f"{args.corpus.stem}-{args.kilobytes}kb.txt"
        head = args.corpus.read_bytes()[: args.kilobytes * 1000]
        corpus.write_bytes(head.decode("utf-8", errors="ignore").encode())  # no character cut in half
        for round_number in range(args.rounds):
            order = ("before", "after") if round_number % 2 == 0 else ("after", "before")
            for name in order:
                run = one_run(getattr(args, name).resolve(), corpus, Path(work) / name, train_options)
                rate = run["steps"] / run["seconds"]
                print(
                    f"round {round_number + 1}, {name}: {run['steps']} steps in {run['seconds']:.1f} s, "
                    f"{rate:.2f} steps/s ({run['dtype']})",
                    flush=True,
                )
                best[name] = max(best[name], rate)
    before, after = best["before"], best["after"]
    print(f"best: before {before:.2f}, after {after:.2f} steps/s: {after / before:.3f}x")


if __name__ == "__main__":
    main()
