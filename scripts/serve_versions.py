"""Served tokens/s of two source trees of aftgen side by side: a fresh default `aftgen serve` of each, alternating.

    python scripts/serve_versions.py BEFORE_TREE AFTER_TREE [--rounds 3] [--tokens 256]

Each round starts one server from each tree in turn (its code put first on PYTHONPATH), waits until its
`/health` admits requests (the bench's ServerProcess does), warms it with a short phase at each width, then
times 1 and 32 concurrent streams of `--tokens` tokens each; the figure kept for a tree is its best round
(other processes only ever add time). The clients are the bench's own (aftgen.bench.serve) from the tree this
script runs in. Prints each round and the ratios after / before.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from aftgen.bench.options import BenchServeOptions
from aftgen.bench.serve import ServerProcess, phase_figures, run_phase

WIDTHS = (1, 32)


def one_server(tree: Path, tokens: int) -> dict[int, float]:
    env = os.environ | {"PYTHONPATH": str(tree)}
    with ServerProcess(BenchServeOptions(tokens=tokens), env=env) as server:
        for streams in WIDTHS:
            asyncio.run(run_phase(server.host, server.port, streams, 16))
        return {
            streams: phase_figures(asyncio.run(run_phase(server.host, server.port, streams, tokens)))["tokens_per_s"]
            for streams in WIDTHS
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    best: dict[str, dict[int, float]] = {"before": dict.fromkeys(WIDTHS, 0.0), "after": dict.fromkeys(WIDTHS, 0.0)}
    for round_number in range(args.rounds):
        order = ("before", "after") if round_number % 2 == 0 else ("after", "before")
        for name in order:
            figures = one_server(getattr(args, name).resolve(), args.tokens)
            shown = ", ".join(f"{streams} streams {rate:,.0f} tokens/s" for streams, rate in figures.items())
            print(f"round {round_number + 1}, {name}: {shown}", flush=True)
            for streams, rate in figures.items():
                best[name][streams] = max(best[name][streams], rate)
    for streams in WIDTHS:
        before, after = best["before"][streams], best["after"][streams]
        print(f"{streams:>2} streams: before {before:,.0f}, after {after:,.0f} tokens/s: {after / before:.3f}x")


if __name__ == "__main__":
    main()
