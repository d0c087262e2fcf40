"""`aftgen bench serve` (aftgen/bench/serve.py): each phase's figures from the clients' timings, and a real server
measured at 1, 8 and 32 streams and judged against the targets."""

from __future__ import annotations

import math
import re

import pytest
from conftest import DEVICE

from aftgen.bench.options import BenchServeOptions
from aftgen.bench.serve import StreamTiming, bench_serve, best_of, phase_figures

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_serve_figures():
    """Each phase's figures from the clients' timings: pooled gaps, first-chunk delays, tokens over wall time."""
    timings = [StreamTiming(sent=0.0, arrivals=[0.1, 0.2, 0.4], tokens=3, ended=0.5),
               StreamTiming(sent=0.5, arrivals=[0.6, 0.7], tokens=2, ended=1.0)]  # fmt: skip
    figures = phase_figures(timings)
    assert figures["tokens_per_s"] == pytest.approx(5 / 1.0)
    assert figures["itl_p50_ms"] == pytest.approx(100) and figures["itl_p99_ms"] == pytest.approx(200)
    assert figures["ttft_p50_ms"] == pytest.approx(100) and figures["ttft_max_ms"] == pytest.approx(100)
    later = figures | {"tokens_per_s": 4.0, "itl_p99_ms": 150.0, "rss_mb": 9.0, "peak_rss_mb": 9.0}
    best = best_of([figures | {"rss_mb": 1.0, "peak_rss_mb": 2.0, "ceiling_tokens_per_s": 6.0},
                    later | {"ceiling_tokens_per_s": 7.0}])  # fmt: skip
    assert (best["tokens_per_s"], best["itl_p99_ms"], best["peak_rss_mb"]) == (5.0, 150.0, 2.0)
    assert best["ceiling_tokens_per_s"] == 7.0  # each speed the best round's, the served one and the ceiling


def test_bench_serve_runs_a_server_and_reports_against_the_targets(tiny_run):
    """Every figure for 1, 8 and 32 streams, the engine's ceiling beside each, 32 streams with scores and with a
    schema, and each target judged from those very figures."""
    lines: list[str] = []
    rows = bench_serve(
        # batch invariance set, not judged at the server's start: one step to compile, not two to time
        BenchServeOptions(model=str(tiny_run), tokens=16, rounds=2, threads=1, device=DEVICE, batch_invariant=True),
        log=lines.append,
    )
    figure = {
        (row["measure"], row["streams"]): row["value"] for row in rows if "streams" in row and "target" not in row
    }
    assert {streams for _, streams in figure} == {1, 8, 32} and len(figure) == 3 * 8 + 2
    for streams in (1, 8, 32):
        assert figure["aggregate throughput", streams] > 0
        assert figure["engine's ceiling: batched step and sampling, no HTTP", streams] > 0
        p50, p99 = figure["inter-token latency p50", streams], figure["inter-token latency p99", streams]
        # NaN where each stream's text came in one chunk: a compiled tiny model outruns the HTTP side, which merges
        assert (math.isnan(p50) and math.isnan(p99)) or 0 < p50 <= p99
        assert 0 < figure["time to first token p50", streams] <= figure["time to first token, slowest stream", streams]
        assert figure["server resident memory", streams] <= figure["server peak resident memory", streams]
    state_mb = float(re.search(r"state ([\d.]+) MB", lines[0]).group(1))
    assert re.search(r", 1 threads$", lines[0])  # the ceiling's threads: the server's own
    expected = (
        {
            ("aggregate tokens/s, 32 streams / 1 stream", None): figure["aggregate throughput", 32]
            / figure["aggregate throughput", 1],
            ("ITL p99 at 32 streams / single-stream step (ITL p50 at 1)", None): figure["inter-token latency p99", 32]
            / figure["inter-token latency p50", 1],
            ("ITL p99 / p50 at 32 streams", None): figure["inter-token latency p99", 32]
            / figure["inter-token latency p50", 32],
            ("peak resident memory growth 1 -> 32 streams, beyond 32 states", None): figure[
                "server peak resident memory", 32
            ]
            - figure["server peak resident memory", 1]
            - 32 * state_mb,
        }
        | {
            ("served tokens/s / the engine's ceiling (no HTTP)", streams): figure["aggregate throughput", streams]
            / figure["engine's ceiling: batched step and sampling, no HTTP", streams]
            for streams in (1, 8, 32)
        }
        | {
            (f"tokens/s at 32 streams, {asked} on each / free", None): figure[f"aggregate throughput, {name}", 32]
            / figure["aggregate throughput", 32]
            for name, asked in (("logprobs", "logprobs: 5"), ("constrained", "a JSON schema"))
        }
    )
    targets = {(row["measure"], row.get("streams")): row for row in rows if "target" in row}
    assert set(targets) == set(expected)
    for measure, value in expected.items():
        assert targets[measure]["value"] == pytest.approx(value, rel=1e-2, abs=0.05, nan_ok=True), measure  # rounded
        relation, bound = targets[measure]["target"].split()
        judged = targets[measure]["value"]
        assert targets[measure]["ok"] == (judged >= float(bound) if relation == ">=" else judged <= float(bound))
