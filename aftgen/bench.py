"""Benchmarks, measured on the machine at hand and printed as a table or as JSON rows.

`generate`: what the recurrent decoder promises, checked against its targets in one run: per-token
latency at batch 1 after long contexts (reached fast by reading random tokens in the parallel
form), prompt ingestion speed, resident memory over a long generation, and the floor, the time of
the model's own matrix-vector products alone, measured in the same run.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from aftgen.model import AFTLM, AFTConfig, StepFunction, compile_step
from aftgen.sampling import PROMPT_CHUNK, Context, SamplingOptions, generate, new_generator

Row = dict  # {"measure", "value", "unit", optional "context", "target", "ok"}

CONTEXTS = (1_000, 8_000, 32_000, 100_000)
GENERATED = (1_000, 100_000)  # generated-token counts at which memory is compared
TIMED_STEPS = 300


def random_model(preset: str = "small", vocab_size: int = 1024, seed: int = 0) -> AFTLM:
    """A randomly initialised model of a training preset: for timing only."""
    from aftgen.training import PRESETS

    torch.manual_seed(seed)
    sizes = {name: value for name, value in PRESETS[preset].items() if name != "batch_size"}
    return AFTLM(AFTConfig(vocab_size=vocab_size, **sizes)).eval()


def memory_mb() -> tuple[float, float]:
    """(resident, peak resident) memory of this process in MB."""
    fields = {}
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    peak = fields.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return fields.get("VmRSS", peak), peak


def _median_ms(run, repeats: int, rounds: int = 5) -> float:
    """Median over `rounds` of the mean time of `repeats` calls, in ms, after a warm-up round."""
    run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        times.append((time.perf_counter() - start) / repeats * 1e3)
    return statistics.median(times)


def matvec_floor_ms(model: AFTLM) -> float:
    """Time of one token's matrix-vector products alone (every Linear, plus the tied output layer)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {lin.in_features: torch.randn(1, lin.in_features) for lin in linears}
    hidden = torch.randn(1, model.config.n_embd)

    def products() -> None:
        for lin in linears:
            F.linear(inputs[lin.in_features], lin.weight, lin.bias)
        F.linear(hidden, model.embed.weight)

    with torch.inference_mode():
        return _median_ms(products, TIMED_STEPS // 5)


def step_ms(step: StepFunction, model: AFTLM, state, repeats: int = TIMED_STEPS) -> float:
    """Per-token latency at batch 1 from `state` (a copy is stepped, so `state` itself stays put)."""
    from aftgen.model import clone_state

    scratch = clone_state(state)
    token = torch.ones(1, dtype=torch.long)
    with torch.inference_mode():
        return _median_ms(lambda: step(token, scratch), repeats // 5)


def bench_generate(model: AFTLM, log=print) -> list[Row]:
    """Every measurement of `aftgen bench generate`, as rows (targets from the issue's bar)."""
    rows: list[Row] = []

    def row(measure: str, value: float, unit: str, **extra) -> None:
        rows.append({"measure": measure, "value": round(value, 4), "unit": unit, **extra})
        log(f"  {measure}: {value:.4g} {unit}")

    floor = matvec_floor_ms(model)
    row("matvec floor", floor, "ms/token")
    started = time.perf_counter()
    compiled, note = compile_step(model)
    row("compile warm-up (once per process, not in latencies)", time.perf_counter() - started, "s", note=note)

    # Long contexts, reached by reading random tokens in the parallel form, chunk by chunk.
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT_CHUNK), generator=torch.Generator().manual_seed(0))
    state, position, read_seconds, latency = model.initial_state(1), 0, 0.0, {}
    for context in CONTEXTS:
        start = time.perf_counter()
        with torch.inference_mode():
            while position < context:
                chunk = ids[:, : min(PROMPT_CHUNK, context - position)]
                _, state = model.prefill(chunk, state)
                position += chunk.shape[1]
        read_seconds += time.perf_counter() - start
        if context == CONTEXTS[0]:
            eager = step_ms(model.step, model, state)
            row("step latency, eager (before fusion)", eager, "ms/token", context=context)
        latency[context] = step_ms(compiled, model, state)
        row("step latency" + ("" if compiled is not model.step else " (eager: no compiler)"), latency[context], "ms/token", context=context)
    ingest = position / read_seconds
    row("prompt ingestion", ingest, "tokens/s")

    # Memory over a long real generation (sampling included), with the fast step.
    options = SamplingOptions(max_new_tokens=-1, temperature=0.8, seed=0)
    context = Context(model.initial_state(1), torch.zeros(1, model.config.vocab_size), new_generator(0))
    memory, marks = {}, iter(GENERATED)
    mark, start = next(marks), time.perf_counter()
    for _ in generate(model, _NullTokenizer(model.config.vocab_size), context, options, compiled):
        made = int(context.state[0]["position"])
        if made >= mark:
            memory[mark] = memory_mb()
            if made == GENERATED[0]:
                start = time.perf_counter()
            mark = next(marks, None)
            if mark is None:
                break
    generation_ms = (time.perf_counter() - start) / (GENERATED[-1] - GENERATED[0]) * 1e3
    for count in GENERATED:
        row("resident memory", memory[count][0], "MB", generated=count)
        row("peak resident memory", memory[count][1], "MB", generated=count)
    row("generation incl. sampling", generation_ms, "ms/token", generated=f"{GENERATED[0]}-{GENERATED[-1]}")

    first, last = latency[CONTEXTS[0]], latency[CONTEXTS[-1]]
    growth = memory[GENERATED[-1]][1] - memory[GENERATED[0]][1]
    step = latency[CONTEXTS[0]]
    for measure, value, unit, target, ok in (
        ("latency after 100k / after 1k", last / first, "x", "<= 1.10", last / first <= 1.10),
        ("peak memory growth, 1k -> 100k generated", growth, "MB", "<= 5", growth <= 5),
        ("ingestion speed-up per token vs stepping", ingest * step / 1e3, "x", ">= 20", ingest * step / 1e3 >= 20),
        ("step latency / floor", step / floor, "x", "<= 3", step / floor <= 3),
        ("fusion speed-up (eager / fused step)", eager / step, "x", None, None),
    ):
        row(measure, value, unit, target=target, ok=ok)
    return rows


class _NullTokenizer:
    """One space per token: generation without real text handling, so the benchmark times the model."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def stream_decoder(self):
        return self

    def feed(self, token: int) -> str:
        return " "

    def feed_bytes(self, data: bytes) -> str:
        return ""

    def flush(self) -> str:
        return ""


def print_rows(rows: list[Row], as_json: bool) -> None:
    """One JSON object per line, or an aligned table, on stdout."""
    if as_json:
        for item in rows:
            print(json.dumps(item))
        return
    for item in rows:
        where = ", ".join(f"{k} {v}" for k, v in item.items() if k not in ("measure", "value", "unit", "target", "ok", "note"))
        verdict = "" if item.get("target") is None else f"  target {item['target']}: {'ok' if item['ok'] else 'MISSED'}"
        note = f"  ({item['note']})" if item.get("note") else ""
        label = item["measure"] + (f" [{where}]" if where else "")
        print(f"{label:<62} {item['value']:>12,.4g} {item['unit']:<9}{verdict}{note}")
    sys.stdout.flush()
