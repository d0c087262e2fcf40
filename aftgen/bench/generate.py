"""`aftgen bench generate`: what the recurrent decoder promises, checked against its targets in one run.

Per-token latency at batch 1 after long contexts (reached fast by reading random tokens in the
parallel form), prompt ingestion speed, resident memory over a long generation, and the floor: the
time of the model's own matrix-vector products alone, measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from aftgen.bench.measure import fastest_side_by_side, memory_mb, prefill_timer, products_timer, read_until, step_timer
from aftgen.bench.targets import TARGETS, Row
from aftgen.compiled.functions import compile_prefill
from aftgen.compiled.step import compile_step
from aftgen.generation.controls import SamplingOptions
from aftgen.generation.loop import generate
from aftgen.generation.prompt import PROMPT_CHUNK, PromptReader
from aftgen.model import AFTLM, AFTConfig, clone_state, tokens_read

CONTEXTS = (1_000, 8_000, 32_000, 100_000)
GENERATED = (1_000, 100_000)  # generated-token counts at which memory is compared
STRETCH = 500  # generated tokens per timing of the generation loop
# Many short rounds rather than a few long ones: the machine's slow spells last seconds; spread
# over a hundred rounds, every timer also runs in its quiet stretches.
ROUNDS, CALLS_PER_ROUND = 100, 10


def random_model(preset: str = "small", vocab_size: int = 1024, seed: int = 0) -> AFTLM:
    """A randomly initialised model of a preset: timing depends on the sizes, not on the weights."""
    torch.manual_seed(seed)
    return AFTLM(AFTConfig.from_preset(preset, vocab_size)).eval()


def bench_generate(
    model: AFTLM,
    log: Callable[[str], None] = print,
    contexts: tuple[int, ...] = CONTEXTS,
    generated: tuple[int, int] = GENERATED,
) -> list[Row]:
    """Every measurement of `aftgen bench generate`, as rows, the targets judged last: latency after
    each of `contexts`, memory after each of `generated` tokens (multiples of STRETCH)."""
    rows: list[Row] = []

    def row(measure: str, value: float, unit: str, **extra) -> None:
        rows.append({"measure": measure, "value": round(value, 4), "unit": unit, **extra})
        log(f"  {measure}: {value:.4g} {unit}")

    step, reader = _compiled(model, row)
    ms = _time_side_by_side(model, step, reader, contexts)
    floor, ceiling, latency = ms["floor"], ms["ceiling"], {c: ms[c] for c in contexts}
    row("matvec floor", floor, "ms/token")
    row(f"matmul ceiling of ingestion ({PROMPT_CHUNK}-token chunks)", ceiling, "ms/token")
    row("step latency, eager (before fusion)", ms["eager"], "ms/token", context=contexts[0])
    for context in contexts:
        label = "step latency" + ("" if step != model.step else " (eager: no compiler)")
        row(label, latency[context], "ms/token", context=context)
    ingest = 1e3 / ms["ingestion"]
    row(
        f"prompt ingestion, eager (before fusion, {PROMPT_CHUNK}-token chunks)",
        1e3 / ms["ingestion, eager"],
        "tokens/s",
    )
    how = "compiled" if reader != model.prefill else "eager: no compiler"
    row(f"prompt ingestion ({PROMPT_CHUNK}-token chunks, {how})", ingest, "tokens/s")
    memory = _generate_and_weigh(model, step, row, generated)

    # The step's cost does not depend on the context, so the ratios take the median of its four
    # timings: one context's timing alone can be far off on a shared machine.
    typical = statistics.median(latency.values())
    # The targets name the default lengths; `compared` says which these rows compare.
    growth = latency[contexts[-1]] / latency[contexts[0]]
    rows.append(TARGETS["latency growth"].judge(growth) | {"compared": f"context {contexts[0]} -> {contexts[-1]}"})
    weight = memory[generated[-1]][1] - memory[generated[0]][1]
    rows.append(TARGETS["memory growth"].judge(weight) | {"compared": f"generated {generated[0]} -> {generated[-1]}"})
    rows.append(TARGETS["ingestion speed-up"].judge(ingest * typical / 1e3))
    # What this machine allows at best: a step can beat its matvec floor, but ingestion cannot beat its matmuls.
    row("ingestion speed-up ceiling (step / matmul ceiling)", typical / ceiling, "x")
    row("ingestion / its matmul ceiling", ingest * ceiling / 1e3, "x")
    rows.append(TARGETS["step over floor"].judge(typical / floor))
    row("fusion speed-up (eager / fused step)", ms["eager"] / typical, "x")
    return rows


def _compiled(model: AFTLM, row) -> tuple[Callable, Callable]:
    """The compiled step and chunk reader, their warm-up times reported (once per process); one that cannot be
    compiled is said on stderr (aftgen.compiled.availability): every figure after it is the eager one's."""
    started = time.perf_counter()
    step, note = compile_step(model)
    label = "compile warm-up of the step (once per process, not in latencies)"
    row(label, time.perf_counter() - started, "s", note=note)
    started = time.perf_counter()
    reader, note = compile_prefill(model, PROMPT_CHUNK)
    label = f"compile warm-up of the {PROMPT_CHUNK}-token chunk reader (once per process)"
    row(label, time.perf_counter() - started, "s", note=note)
    return step, reader


def _time_side_by_side(model: AFTLM, step: Callable, reader: Callable, contexts: tuple[int, ...]) -> dict:
    """ms/token of the floor, the compiled step after each context, the eager step, the ceiling and
    ingestion, taking turns in every round."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT_CHUNK), generator=generator)
    state, states = model.initial_state(1), {}
    for context in contexts:  # long contexts, reached by reading random tokens chunk by chunk
        state = read_until(model, ids, state, context)
        states[context] = clone_state(state)
    calls, longest = CALLS_PER_ROUND, states[contexts[-1]]
    timers = {
        # The compiled steps one after another, after the floor's alike matvecs: one taking its turn
        # right after the eager step runs slow on what that left in the caches.
        "floor": products_timer(model, calls=calls),
        **{context: step_timer(step, states[context], calls) for context in contexts},
        "eager": step_timer(model.step, states[contexts[0]], calls),
        "ceiling": products_timer(model, PROMPT_CHUNK, calls),
        "ingestion": prefill_timer(reader, ids, longest),
        "ingestion, eager": prefill_timer(model.prefill, ids, longest),
    }
    return fastest_side_by_side(timers, ROUNDS, model.embed.weight.device)


def _generate_and_weigh(
    model: AFTLM, step: Callable, row, generated: tuple[int, int]
) -> dict[int, tuple[float, float]]:
    """Generate (sampling included) with the fast step, timing 500-token stretches and weighing the
    process after `generated` tokens; returns {generated: (resident, peak) MB}."""
    options = SamplingOptions(max_new_tokens=-1, temperature=0.8, seed=0)
    with torch.inference_mode():  # as read_prompt reads: the compiled step's graph is specific to that
        context = PromptReader(model, [], seed=0).finish()  # no prompt: the step's cost does not depend on one
    memory, stretches, stretch_start = {}, [], time.perf_counter()
    for _ in generate(model, _NullTokenizer(), context, options, step):
        made = tokens_read(context.state)
        if made % STRETCH == 0:  # the fastest stretch can then be set beside the step's fastest
            now = time.perf_counter()
            stretches.append((now - stretch_start) / STRETCH * 1e3)
            stretch_start = now
        if made in generated:
            memory[made] = memory_mb()
            if made == generated[-1]:
                break
    for count in generated:
        row("resident memory", memory[count][0], "MB", generated=count)
        row("peak resident memory", memory[count][1], "MB", generated=count)
    timed, span = stretches[generated[0] // STRETCH :], f"{generated[0]}-{generated[-1]}"  # after the first
    row("generation incl. sampling, mean", statistics.mean(timed), "ms/token", generated=span)
    row(f"generation incl. sampling, fastest {STRETCH}-token stretch", min(timed), "ms/token", generated=span)
    return memory


class _NullTokenizer:
    """One space per token: generation without real text handling, so the benchmark times the model."""

    def stream_decoder(self):
        return self

    def feed(self, token: int) -> str:
        return " "

    def feed_bytes(self, data: bytes) -> str:
        return ""

    def flush(self) -> str:
        return ""
