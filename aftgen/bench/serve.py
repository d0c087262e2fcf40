"""`aftgen bench serve`: a real `aftgen serve` in its own process, driven by 1, 8 and 32 concurrent streaming clients.

Per phase: aggregate tokens/s (every stream's tokens over the phase's wall time), inter-token
latency p50/p99 (gaps between a stream's chunks, all streams pooled), time to first token, and the
server's resident memory. The clients are plain asyncio sockets in this process (no dependency
beyond the standard library), so the server's process holds the server alone.

Beside each phase, in the same round, the engine's ceiling: the batched step and the batched sampling for
that many rows, as the server runs them (its model, device, dtype, step and threads), with no HTTP, in
this process while the server waits. Served / ceiling says how much of the engine's speed reaches clients.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aftgen.bench.measure import tree_memory_mb
from aftgen.bench.options import STREAMS, BenchServeOptions
from aftgen.bench.targets import TARGETS, Row
from aftgen.device import Placement, resolve, synchronize
from aftgen.errors import AftgenError
from aftgen.files import read_text
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.drawing import choose, new_generator
from aftgen.layers import batch_invariant
from aftgen.model import AFTLM
from aftgen.serve.batch import Batch, CompiledBatchStep

PROMPTS = ("ROMEO:", "JULIET:", "KING HENRY:", "First Citizen:", "NURSE:", "HAMLET:", "LADY MACBETH:", "GLOUCESTER:")
START_TIMEOUT = 180.0  # seconds for the server to load its model and listen
LOG_LIMIT = 64 << 20  # bytes: a child's log a bench reads (a few KB; a runaway one is an error, not a hang)
TEMPERATURE = 0.8  # what every stream asks for
# What a request may ask beside its text, each timed at 32 streams against the same streams free (issue 48):
# scores with five alternatives a token, and a shape no stream completes early (a JSON string of any length),
# so both phases make the same tokens but for the masks.
ASKS = {
    "logprobs": {"logprobs": 5},
    "constrained": {
        "json_schema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    },
}


@dataclass
class StreamTiming:
    sent: float
    arrivals: list[float] = field(default_factory=list)  # when each chunk with text came
    tokens: int = 0  # from the closing usage chunk
    ended: float = 0.0


async def _body_pieces(reader: asyncio.StreamReader, chunked: bool):
    """The response body as it arrives (HTTP/1.1 chunked transfer encoding, or until the server closes)."""
    while True:
        if not chunked:
            piece = await reader.read(65536)
            if not piece:
                return
            yield piece
            continue
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        yield (await reader.readexactly(size + 2))[:-2]


async def stream_once(host: str, port: int, body: dict) -> StreamTiming:
    """POST one streaming completion and time its chunks."""
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    timing = StreamTiming(sent=time.perf_counter())
    status = await reader.readline()
    if b" 200 " not in status:
        raise AftgenError(f"bench serve: the server answered {status.decode().strip()}: {await reader.read(500)}")
    headers = b""
    while (line := await reader.readline()) not in (b"\r\n", b""):
        headers += line.lower()
    buffer = b""
    async for piece in _body_pieces(reader, b"transfer-encoding: chunked" in headers):
        buffer += piece
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            if event.startswith(b'data: {"id"') and b'"text":""' not in event:  # a chunk with text: time it only
                if b'"usage":{' in event:
                    timing.tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                else:
                    timing.arrivals.append(time.perf_counter())
    timing.ended = time.perf_counter()
    writer.close()
    return timing


async def run_phase(host: str, port: int, streams: int, tokens: int, ask: dict | None = None) -> list[StreamTiming]:
    """`streams` concurrent streaming requests of `tokens` tokens each (with `ask`'s fields), timed."""
    bodies = [
        {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": TEMPERATURE, "seed": i,
         "stream": True, "stream_options": {"include_usage": True}} | (ask or {})
        for i in range(streams)
    ]  # fmt: skip
    return list(await asyncio.gather(*(stream_once(host, port, body) for body in bodies)))


class ServerProcess:
    """`aftgen serve` on a free loopback port in a child process, for the length of a `with` block."""

    def __init__(self, options: BenchServeOptions, env: dict[str, str] | None = None):
        command = [sys.executable, "-m", "aftgen", "serve", "--port", "0", "--parallel", str(max(STREAMS)),
                   "--queue", "0", "--max-tokens", str(options.tokens), "--device", options.device,
                   "--dtype", options.dtype]  # fmt: skip
        command += ["--model", options.model] if options.model else []
        command += ["--threads", str(options.threads)] if options.threads else []
        if options.batch_invariant is not None:
            command += ["--batch-invariant" if options.batch_invariant else "--no-batch-invariant"]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="aftgen-bench-serve-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log, env=env
        )
        self.host, self.port = self._address()
        self._until_ready()

    def _address(self) -> tuple[str, int]:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            found = re.search(r"at http://([\d.]+):(\d+)/v1", read_log(self.log.name))
            if found:
                return found.group(1), int(found.group(2))
            if self.process.poll() is not None:
                said = read_log(self.log.name)[-500:]  # before close() deletes the log
                self.close()
                raise AftgenError(f"bench serve: the server did not start: {said}")
            time.sleep(0.1)
        self.close()
        raise AftgenError(f"bench serve: the server did not listen within {START_TIMEOUT:.0f} s")

    def _until_ready(self) -> None:
        """Wait until /health admits requests (503 while the server's step compiles)."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                self.health()
                return
            except urllib.error.HTTPError as error:
                if error.code != 503:
                    raise
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        said = read_log(self.log.name)[-500:]
        self.close()
        raise AftgenError(f"bench serve: the server was not ready within {START_TIMEOUT:.0f} s: {said}")

    def health(self) -> dict:
        with urllib.request.urlopen(f"http://{self.host}:{self.port}/health", timeout=30) as response:
            return json.load(response)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_log(path: Path | str) -> str:
    """What a child the bench started has written to its log so far."""
    return read_text(path, LOG_LIMIT, "the bench's log of a child")


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of values."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))] if ordered else float("nan")


def phase_figures(timings: list[StreamTiming]) -> dict[str, float]:
    gaps = [b - a for t in timings for a, b in zip(t.arrivals, t.arrivals[1:], strict=False)]
    first = [t.arrivals[0] - t.sent for t in timings if t.arrivals]
    wall = max(t.ended for t in timings) - min(t.sent for t in timings)
    return {
        "tokens_per_s": sum(t.tokens for t in timings) / wall,
        "itl_p50_ms": 1e3 * percentile(gaps, 0.50),
        "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
        "ttft_p50_ms": 1e3 * statistics.median(first) if first else float("nan"),
        "ttft_max_ms": 1e3 * max(first, default=float("nan")),
    }


def bench_serve(options: BenchServeOptions, log=print) -> list[Row]:
    """Start a server and drive it with 1, 8 and 32 concurrent streams in turn, for `rounds` rounds, the
    engine's ceiling timed beside each phase, then 32 streams with each of ASKS; each figure is the best of the
    rounds (other processes only ever add time). Rows with the issue's targets."""
    rounds: dict[int, list[dict[str, float]]] = {streams: [] for streams in STREAMS}
    asked: dict[str, float] = dict.fromkeys(ASKS, 0.0)  # the best tokens/s at 32 streams with each ask
    with ServerProcess(options) as server:
        health = server.health()
        state_mb = health["state_bytes"] / 1e6
        log(f"bench serve: server pid {server.process.pid} at {server.host}:{server.port}, state {state_mb:.3f} MB, "
            f"{health['threads']} threads")  # fmt: skip
        ceiling = Ceiling(options, health["threads"])
        for round_number in range(options.rounds):
            for streams in STREAMS:
                if round_number == 0:  # untimed: the first calls at this batch size pay one-off costs
                    asyncio.run(run_phase(server.host, server.port, streams, 16))
                    ceiling.tokens_per_s(streams, steps=4)
                figures = phase_figures(asyncio.run(run_phase(server.host, server.port, streams, options.tokens)))
                figures["rss_mb"], figures["peak_rss_mb"] = tree_memory_mb(server.process.pid)
                figures["ceiling_tokens_per_s"] = ceiling.tokens_per_s(streams, options.tokens)
                rounds[streams].append(figures)
                log(f"  round {round_number + 1}, {streams:>2} streams: {figures['tokens_per_s']:,.0f} tokens/s "
                    f"(engine's ceiling {figures['ceiling_tokens_per_s']:,.0f}), "
                    f"ITL p50 {figures['itl_p50_ms']:.1f} ms / p99 {figures['itl_p99_ms']:.1f} ms")  # fmt: skip
            for name, figure in timed_asks(server, options.tokens, warm_up=round_number == 0).items():
                asked[name] = max(asked[name], figure)
                log(f"  round {round_number + 1}, {max(STREAMS)} streams, {name}: {figure:,.0f} tokens/s")
    return serve_rows({streams: best_of(figures) for streams, figures in rounds.items()}, state_mb, asked)


def timed_asks(server: ServerProcess, tokens: int, warm_up: bool) -> dict[str, float]:
    """Tokens/s at 32 streams with each of ASKS (`warm_up`: an untimed phase first, which compiles a shape)."""
    timed = {}
    for name, ask in ASKS.items():
        if warm_up:
            asyncio.run(run_phase(server.host, server.port, max(STREAMS), 16, ask))
        timed[name] = phase_figures(asyncio.run(run_phase(server.host, server.port, max(STREAMS), tokens, ask)))
    return {name: figures["tokens_per_s"] for name, figures in timed.items()}


class Ceiling:
    """The engine's own work at a number of rows, with no HTTP: the batched step and the batched sampling,
    as the server runs them (the same model, device, dtype, step and threads), in this process."""

    def __init__(self, options: BenchServeOptions, threads: int):
        from aftgen.api import load

        self.placement: Placement = resolve(options.device, options.dtype, generating=True)
        self.model: AFTLM = load(options.model, self.placement.device)[0].eval().lower_weights(self.placement.weights)
        self.threads = threads
        invariance = batch_invariant(options.batch_invariant, self.placement.device, True)
        # the server's step: --parallel 32
        self.step = CompiledBatchStep(self.model, max(STREAMS), self.placement, invariance=invariance)

    @torch.inference_mode()
    def tokens_per_s(self, streams: int, steps: int) -> float:
        """Rows (from the initial state: a step costs the same at any position) times steps, over their time:
        timed as a phase is, as many steps as a stream's tokens in one stretch, the best round kept."""
        model, threads = self.model, torch.get_num_threads()
        batch = Batch(model, streams, self.step)
        batch.add([(row, model.initial_state(1)) for row in range(streams)])
        rows = [SamplingOptions(temperature=TEMPERATURE)] * streams
        generators = [new_generator(seed) for seed in range(streams)]
        history = torch.zeros(streams, 0, dtype=torch.long)
        logits = torch.zeros(streams, model.config.vocab_size, device=self.placement.device)
        torch.set_num_threads(self.threads)
        try:
            with self.placement.autocast():
                start = time.perf_counter()
                for _ in range(steps):
                    logits = batch.step(choose(logits, rows, history, generators))
                synchronize(self.placement.device)
                return streams * steps / (time.perf_counter() - start)
        finally:
            torch.set_num_threads(threads)


def best_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The most tokens/s and the least of every time; memory as right after the first round's phase (the
    peak only ever grows, so a later round's would carry the other phases' peaks)."""
    best = {key: min(figures[key] for figures in rounds) for key in rounds[0]}
    for speed in ("tokens_per_s", "ceiling_tokens_per_s"):
        best[speed] = max(figures[speed] for figures in rounds)
    best["rss_mb"], best["peak_rss_mb"] = rounds[0]["rss_mb"], rounds[0]["peak_rss_mb"]
    return best


def serve_rows(phases: dict[int, dict[str, float]], state_mb: float, asked: dict[str, float]) -> list[Row]:
    """The measurements as rows, then the targets (32 streams against one, and against 32 streams with each of
    ASKS (`asked`: their tokens/s), measured in the same run)."""
    units = {
        "tokens_per_s": ("aggregate throughput", "tokens/s"),
        "ceiling_tokens_per_s": ("engine's ceiling: batched step and sampling, no HTTP", "tokens/s"),
        "itl_p50_ms": ("inter-token latency p50", "ms"),
        "itl_p99_ms": ("inter-token latency p99", "ms"),
        "ttft_p50_ms": ("time to first token p50", "ms"),
        "ttft_max_ms": ("time to first token, slowest stream", "ms"),
        "rss_mb": ("server resident memory", "MB"),
        "peak_rss_mb": ("server peak resident memory", "MB"),
    }
    rows: list[Row] = [  # to 1 ns: a tiny model's chunks can come microseconds apart
        {"measure": label, "value": round(figures[key], 6), "unit": unit, "streams": streams}
        for streams, figures in phases.items()
        for key, (label, unit) in units.items()
    ]
    rows += [{"measure": f"aggregate throughput, {name}", "value": round(value, 6), "unit": "tokens/s",
              "streams": max(STREAMS)} for name, value in asked.items()]  # fmt: skip
    one, many = phases[1], phases[max(STREAMS)]
    speedup = many["tokens_per_s"] / one["tokens_per_s"]
    latency = many["itl_p99_ms"] / one["itl_p50_ms"]
    growth = many["peak_rss_mb"] - one["peak_rss_mb"]
    reached = [
        TARGETS["served / ceiling"].judge(figures["tokens_per_s"] / figures["ceiling_tokens_per_s"])
        | {"streams": streams}
        for streams, figures in phases.items()
    ]
    return (
        rows
        + reached
        + [
            TARGETS["serve throughput"].judge(speedup),
            TARGETS["serve latency"].judge(latency),
            TARGETS["serve latency spread"].judge(many["itl_p99_ms"] / many["itl_p50_ms"]),
            TARGETS["serve memory"].judge(growth - max(STREAMS) * state_mb),
        ]
        + [TARGETS[f"serve {name}"].judge(value / many["tokens_per_s"]) for name, value in asked.items()]
    )
