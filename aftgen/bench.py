"""Benchmarks, measured on the machine at hand and printed as a table or as JSON rows.

`generate`: what the recurrent decoder promises, checked against its targets in one run: per-token
latency at batch 1 after long contexts (reached fast by reading random tokens in the parallel
form), prompt ingestion speed, resident memory over a long generation, and the floor, the time of
the model's own matrix-vector products alone, measured in the same run.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from aftgen.model import AFTLM, AFTConfig, PrefillFunction, StepFunction, clone_state, compile_prefill, compile_step
from aftgen.sampling import PROMPT_CHUNK, Context, SamplingOptions, generate, new_generator

Row = dict  # {"measure", "value", "unit", optional "context", "target", "ok"}

CONTEXTS = (1_000, 8_000, 32_000, 100_000)
GENERATED = (1_000, 100_000)  # generated-token counts at which memory is compared
STRETCH = 500  # generated tokens per timing of the generation loop
TIMED_STEPS = 300
# bench generate: many short rounds rather than a few long ones. The machine's slow spells last
# seconds; spread over a hundred rounds, every timer also runs in its quiet stretches.
GENERATE_ROUNDS, CALLS_PER_ROUND = 100, 10
WARM_UP_STEPS = 2  # untimed steps per probe: the first few run slower while the allocator's pools grow


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


Timer = tuple[Callable[[], object], int, int]  # (one call, calls per round, tokens per call)


def fastest_side_by_side(timers: dict[str, Timer], rounds: int = 7) -> dict[str, float]:
    """ms per token of each timer: the fastest of `rounds` rounds, the timers taking turns in each round.

    The fastest, not the median: other processes only ever add time. Taking turns: a slow spell of a
    shared machine then hits both sides of a ratio (floor and step, 1k and 100k) instead of one.
    Each turn starts with an untimed call: the first call after another timer's (say, the compiled
    step after the eager one) runs slow on what that one left in the caches, which back-to-back
    generation never sees.
    """
    best = dict.fromkeys(timers, math.inf)
    with torch.inference_mode():
        for _ in range(rounds):
            for name, (run, calls, tokens) in timers.items():
                run()
                start = time.perf_counter()
                for _ in range(calls):
                    run()
                best[name] = min(best[name], (time.perf_counter() - start) / calls / tokens * 1e3)
    return best


def products_timer(model: AFTLM, tokens: int = 1, calls: int = TIMED_STEPS // 5) -> Timer:
    """The model's own matrix products alone, as reading `tokens` tokens at once needs them.

    One token: the matrix-vector products of a step, every Linear plus the tied output layer, bound
    by memory bandwidth (the floor of per-token latency). A chunk: the matrix-matrix products of
    reading a prompt, bound by arithmetic (the ceiling of prompt ingestion); as in AFTLM.prefill,
    the last block's mixer output and MLP, and the output layer, run for the last token alone.
    """
    last_block = set(model.blocks[-1].modules()) - {model.blocks[-1].mixer.qkv}
    linears = [(m, 1 if m in last_block else tokens) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {(rows, lin.in_features): torch.randn(rows, lin.in_features) for lin, rows in linears}
    hidden = torch.randn(1, model.config.n_embd)

    def products() -> None:
        for lin, rows in linears:
            F.linear(inputs[rows, lin.in_features], lin.weight, lin.bias)
        F.linear(hidden, model.embed.weight)

    return products, max(1, calls // tokens), tokens


def step_timer(step: StepFunction, state, calls: int = TIMED_STEPS // 5) -> Timer:
    """One token at batch 1 from `state` (a copy is stepped, so `state` itself stays put)."""
    scratch = clone_state(state)
    token = torch.ones(1, dtype=torch.long)
    return (lambda: step(token, scratch)), calls, 1


def prefill_timer(prefill: PrefillFunction, ids: torch.Tensor, state) -> Timer:
    """Reading the chunk `ids` in the parallel form from `state` (left as it is)."""
    return (lambda: prefill(ids, clone_state(state), last_only=True)), 1, ids.shape[1]


@torch.inference_mode()
def read_until(model: AFTLM, ids: torch.Tensor, state, context: int):
    """Read the chunk `ids` over and over in the parallel form until `state` holds `context` tokens."""
    position = int(state[0]["position"])
    while position < context:
        chunk = ids[:, : min(ids.shape[1], context - position)]
        _, state = model.prefill(chunk, state, last_only=True)
        position += chunk.shape[1]
    return state


def bench_generate(model: AFTLM, log=print) -> list[Row]:
    """Every measurement of `aftgen bench generate`, as rows (targets from the issue's bar)."""
    rows: list[Row] = []

    def row(measure: str, value: float, unit: str, **extra) -> None:
        rows.append({"measure": measure, "value": round(value, 4), "unit": unit, **extra})
        log(f"  {measure}: {value:.4g} {unit}")

    started = time.perf_counter()
    compiled, note = compile_step(model)
    warm_up = time.perf_counter() - started
    started = time.perf_counter()
    reader, reader_note = compile_prefill(model, PROMPT_CHUNK)
    reader_warm_up = time.perf_counter() - started

    # Long contexts, reached by reading random tokens in the parallel form, chunk by chunk.
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT_CHUNK), generator=torch.Generator().manual_seed(0))
    state, states = model.initial_state(1), {}
    for context in CONTEXTS:
        state = read_until(model, ids, state, context)
        states[context] = clone_state(state)
    calls = CALLS_PER_ROUND
    ms = fastest_side_by_side(
        {
            # The compiled steps one after another, after the floor's alike matvecs: in earlier
            # runs the one taking its turn after the eager step ran a fifth slower than the others.
            "floor": products_timer(model, calls=calls),
            **{context: step_timer(compiled, states[context], calls) for context in CONTEXTS},
            "eager": step_timer(model.step, states[CONTEXTS[0]], calls),
            "ceiling": products_timer(model, PROMPT_CHUNK, calls),
            "ingestion": prefill_timer(reader, ids, states[CONTEXTS[-1]]),
            "ingestion, eager": prefill_timer(model.prefill, ids, states[CONTEXTS[-1]]),
        },
        GENERATE_ROUNDS,
    )
    floor, ceiling, eager, latency = ms["floor"], ms["ceiling"], ms["eager"], {c: ms[c] for c in CONTEXTS}
    row("matvec floor", floor, "ms/token")
    row(f"matmul ceiling of ingestion ({PROMPT_CHUNK}-token chunks)", ceiling, "ms/token")
    row("compile warm-up of the step (once per process, not in latencies)", warm_up, "s", note=note)
    row(
        f"compile warm-up of the {PROMPT_CHUNK}-token chunk reader (once per process)",
        reader_warm_up,
        "s",
        note=reader_note,
    )
    row("step latency, eager (before fusion)", eager, "ms/token", context=CONTEXTS[0])
    for context in CONTEXTS:
        row(
            "step latency" + ("" if compiled != model.step else " (eager: no compiler)"),
            latency[context],
            "ms/token",
            context=context,
        )
    ingest = 1e3 / ms["ingestion"]
    row(
        f"prompt ingestion, eager (before fusion, {PROMPT_CHUNK}-token chunks)",
        1e3 / ms["ingestion, eager"],
        "tokens/s",
    )
    row(
        f"prompt ingestion ({PROMPT_CHUNK}-token chunks"
        + (", compiled)" if reader != model.prefill else ", eager: no compiler)"),
        ingest,
        "tokens/s",
    )

    # Memory over a long real generation (sampling included), with the fast step. The context is
    # made in inference mode, as read_prompt makes it: the step's compiled graph is specific to that.
    options = SamplingOptions(max_new_tokens=-1, temperature=0.8, seed=0)
    with torch.inference_mode():
        context = Context(model.initial_state(1), torch.zeros(1, model.config.vocab_size), new_generator(0))
    memory, stretches, stretch_start = {}, [], time.perf_counter()
    for _ in generate(model, _NullTokenizer(model.config.vocab_size), context, options, compiled):
        made = int(context.state[0]["position"])
        if made % STRETCH == 0:  # timed in stretches, so the fastest can be set beside the step's fastest
            now = time.perf_counter()
            stretches.append((now - stretch_start) / STRETCH * 1e3)
            stretch_start = now
        if made in GENERATED:
            memory[made] = memory_mb()
            if made == GENERATED[-1]:
                break
    for count in GENERATED:
        row("resident memory", memory[count][0], "MB", generated=count)
        row("peak resident memory", memory[count][1], "MB", generated=count)
    timed = stretches[GENERATED[0] // STRETCH :]  # after the first 1k tokens
    span = f"{GENERATED[0]}-{GENERATED[-1]}"
    row("generation incl. sampling, mean", statistics.mean(timed), "ms/token", generated=span)
    row(f"generation incl. sampling, fastest {STRETCH}-token stretch", min(timed), "ms/token", generated=span)

    first, last = latency[CONTEXTS[0]], latency[CONTEXTS[-1]]
    growth = memory[GENERATED[-1]][1] - memory[GENERATED[0]][1]
    # The step's cost does not depend on the context, so the ratios take the median of its four
    # timings: one context's timing alone can be off by a fifth on a shared machine.
    step = statistics.median(latency.values())
    for measure, value, unit, target, ok in (
        ("latency after 100k / after 1k", last / first, "x", "<= 1.10", last / first <= 1.10),
        ("peak memory growth, 1k -> 100k generated", growth, "MB", "<= 5", growth <= 5),
        ("ingestion speed-up per token vs stepping", ingest * step / 1e3, "x", ">= 20", ingest * step / 1e3 >= 20),
        # What this machine allows at best: a step can beat its matvec floor, but ingestion cannot beat its matmuls.
        ("ingestion speed-up ceiling (step / matmul ceiling)", step / ceiling, "x", None, None),
        ("ingestion / its matmul ceiling", ingest * ceiling / 1e3, "x", None, None),
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
        where = ", ".join(
            f"{k} {v}" for k, v in item.items() if k not in ("measure", "value", "unit", "target", "ok", "note")
        )
        verdict = "" if item.get("target") is None else f"  target {item['target']}: {'ok' if item['ok'] else 'MISSED'}"
        note = f"  ({item['note']})" if item.get("note") else ""
        label = item["measure"] + (f" [{where}]" if where else "")
        print(f"{label:<62} {item['value']:>12,.4g} {item['unit']:<9}{verdict}{note}")
    sys.stdout.flush()


# The paper's comparison, reproduced side by side: every token mixer at the same width and depth,
# timed in the same run, reported as ratios against attention (machine noise cancels in a ratio).

BASELINE = "attention"
TRAIN_LENGTHS = (256, 1024, 4096)
TOKENS_PER_STEP = 4096  # batch = TOKENS_PER_STEP // length, so every length does the same work per step
DECODE_CONTEXTS = (1_000, 8_000, 32_000)
POSITION_BINS = ((0, 1_000), (1_000, 8_000), (8_000, None))


def comparison_model(mixer: str, context_length: int, preset: str = "small", vocab_size: int = 1024) -> AFTLM:
    """A preset's width and depth with the given mixer and training length, randomly initialised."""
    from aftgen.training import PRESETS

    sizes = {name: value for name, value in PRESETS[preset].items() if name != "batch_size"}
    return AFTLM(AFTConfig(vocab_size=vocab_size, **sizes | {"context_length": context_length, "mixer": mixer}))


def probe(kind: str, mixer: str, length: int, repeats: int, threads: int) -> dict:
    """Time `kind` ("train": a full step, forward + backward + AdamW; "mixer": the token mixer alone,
    forward + backward) and its peak memory. Run in a fresh interpreter per configuration: peak RSS
    (VmHWM) only goes up, so only a fresh process tells one configuration's peak from another's."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    batch = max(1, TOKENS_PER_STEP // length)
    model = comparison_model(mixer, length).train()
    if kind == "train":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, model.config.vocab_size, (batch, length + 1))

        def run() -> None:
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    else:
        mixer_module = model.blocks[0].mixer
        x = torch.randn(batch, length, model.config.n_embd, requires_grad=True)
        grad = torch.randn_like(x)

        def run() -> None:
            y, _ = mixer_module(x)
            y.backward(grad)

    resting, _ = memory_mb()
    for _ in range(WARM_UP_STEPS):  # first-call allocations, the optimiser's moments, the allocator's pools
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    best = min(times)  # the least disturbed run: other processes only ever add time
    return {"seconds": best, "tokens_per_s": batch * length / best, "peak_mb": memory_mb()[1] - resting, "batch": batch}


def _probe_in_subprocess(kind: str, mixer: str, length: int, repeats: int) -> dict:
    import subprocess

    code = "import json, sys; from aftgen.bench import probe; print(json.dumps(probe(*json.loads(sys.argv[1]))))"
    args = json.dumps([kind, mixer, length, repeats, torch.get_num_threads()])
    done = subprocess.run([sys.executable, "-c", code, args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"benchmark probe {kind} {mixer} T={length} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _with_ratios(rows: list[Row]) -> list[Row]:
    """Add each row's ratio against the baseline mixer's row of the same measure and length."""
    base = {(r["measure"], r.get("length"), r.get("context")): r["value"] for r in rows if r["mixer"] == BASELINE}
    for r in rows:
        reference = base.get((r["measure"], r.get("length"), r.get("context")))
        if reference:
            r["vs_attention"] = round(r["value"] / reference, 3)
    return rows


def bench_train(mixers: tuple[str, ...], repeats: int = 3, rounds: int = 2, log=print) -> list[Row]:
    """Training-step tokens/s and peak memory, and the mixer alone, per mixer and length.

    Every configuration is probed `rounds` times, the rounds going over all of them in turn, and the
    fastest round counts: a slow spell of a shared machine then cannot sink one mixer's figure alone.
    """
    fastest: dict[tuple[str, str, int], dict] = {}
    for round_number in range(1, rounds + 1):
        for length in TRAIN_LENGTHS:
            for mixer in mixers:
                for kind in ("train", "mixer"):
                    got = _probe_in_subprocess(kind, mixer, length, repeats)
                    best = fastest.setdefault((kind, mixer, length), got)
                    if got["seconds"] < best["seconds"]:
                        fastest[kind, mixer, length] = got
                train, alone = fastest["train", mixer, length], fastest["mixer", mixer, length]
                log(
                    f"  round {round_number}/{rounds}, T={length} {mixer}: train step {train['tokens_per_s']:,.1f} tokens/s, "
                    f"peak memory {train['peak_mb']:,.1f} MB; mixer fwd+bwd {alone['seconds'] * 1e3:,.1f} ms, "
                    f"peak memory {alone['peak_mb']:,.1f} MB (fastest so far)"
                )
    rows: list[Row] = []
    for (kind, mixer, length), got in fastest.items():
        where = {"mixer": mixer, "length": length, "batch": got["batch"]}
        if kind == "train":
            rows.append({"measure": "train step", "value": round(got["tokens_per_s"], 1), "unit": "tokens/s", **where})
            rows.append({"measure": "train peak memory", "value": round(got["peak_mb"], 1), "unit": "MB", **where})
        else:
            rows.append({"measure": "mixer fwd+bwd", "value": round(got["seconds"] * 1e3, 2), "unit": "ms", **where})
            rows.append({"measure": "mixer peak memory", "value": round(got["peak_mb"], 1), "unit": "MB", **where})
    return _with_ratios(rows)


def _filled_attention_cache(model: AFTLM, context: int) -> list:
    """A KV cache already holding `context` tokens (random keys and values: a step's cost depends on
    how many there are, not what they are, and reading 32k tokens through attention takes minutes)."""
    state = model.initial_state(1)
    for layer in state:
        shape = (1, model.blocks[0].mixer.n_head, context + TIMED_STEPS, model.blocks[0].mixer.head_dim)
        layer["keys"], layer["values"] = torch.randn(shape), torch.randn(shape)
        layer["position"].fill_(context)
    return state


def bench_decode(repeats: int = 100, log=print) -> list[Row]:
    """Per-token latency at batch 1 after 1k, 8k, 32k tokens, and the state's size: aft_local's
    recurrent state against attention's KV cache, same width and depth, each with the fastest step
    aftgen has for it. aft_local's fixed-shape step compiles (`aftgen sample --compile`); its eager
    latency is shown too. Attention's step stays eager: its cache grows every token, and at long
    contexts its time goes to reading that cache, which no fusion shortens."""
    rows: list[Row] = []
    ids = torch.randint(0, 1024, (1, PROMPT_CHUNK), generator=torch.Generator().manual_seed(0))
    for mixer in ("aft_local", BASELINE):
        torch.manual_seed(0)
        model = comparison_model(mixer, 128).eval()
        step, note = compile_step(model) if mixer != BASELINE else (model.step, "eager")
        state = model.initial_state(1)
        for context in DECODE_CONTEXTS:
            if mixer == BASELINE:
                state = _filled_attention_cache(model, context)
            else:  # the real thing: read random tokens in the parallel form
                state = read_until(model, ids, state, context)
            where = {"mixer": mixer, "context": context}
            timers = {"step": step_timer(step, state, repeats // 5)}
            if step != model.step:  # bound methods: equal, never identical
                timers["eager"] = step_timer(model.step, state, repeats // 5)
            ms = fastest_side_by_side(timers)
            latency = ms["step"]
            size = sum(t.numel() * t.element_size() for layer in state for t in layer.values()) / 2**20
            rows.append(
                {"measure": "decode step", "value": round(latency, 3), "unit": "ms/token", "step": note, **where}
            )
            if "eager" in ms:
                rows.append(
                    {"measure": "decode step, eager", "value": round(ms["eager"], 3), "unit": "ms/token", **where}
                )
            rows.append({"measure": "decode state memory", "value": round(size, 3), "unit": "MB", **where})
            log(f"  {mixer} after {context:,} tokens: {latency:.2f} ms/token ({note}), state {size:.2f} MB")
    return _with_ratios(rows)


def bench_quality(corpus: Path, seconds: float, mixers: tuple[str, ...], log=print) -> list[Row]:
    """Train each mixer for the same wall time on the same split; held-out nats/char and bits/char.

    Every mixer is scored the same way: the held-out text in windows of the training length (the
    paper's protocol, and the most context attention was trained for). aft_local is also read as
    one stream, by position, to show whether its quality holds past the training length.
    """
    import math
    import tempfile

    from aftgen.checkpoint import load_checkpoint
    from aftgen.corpus import prepare_corpus
    from aftgen.evaluate import evaluate_ids, stream_nll
    from aftgen.training import TrainOptions, train

    data = prepare_corpus([corpus], TrainOptions(corpus=corpus).corpus_options(), log=lambda _: None)
    ids = data.held_out_ids.long()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="aftgen-bench-") as folder:
        for mixer in mixers:
            log(f"  training {mixer} for {seconds:g} s ...")
            options = TrainOptions(
                corpus=corpus,
                out=Path(folder) / mixer,
                mixer=mixer,
                max_time=seconds,
                max_steps=10**9,
                eval_interval=10**9,
            )
            model, tokenizer = load_checkpoint(train(options, quiet=True))
            result = evaluate_ids(
                model, ids, data.held_out_chars, data.held_out_bytes, reset_every=model.config.context_length
            )
            where = {
                "mixer": mixer,
                "train_seconds": seconds,
                "eval": f"windows of {model.config.context_length} tokens",
            }
            rows.append({"measure": "held-out", "value": round(result.nats_per_char, 4), "unit": "nats/char", **where})
            rows.append({"measure": "held-out", "value": round(result.bits_per_char, 4), "unit": "bits/char", **where})
            log(f"  {mixer}: {result.nats_per_char:.4f} nats/char ({result.bits_per_char:.4f} bits/char)")
            if mixer != "aft_local":
                continue
            nll = stream_nll(model, ids)
            for low, high in POSITION_BINS:
                if low >= len(nll):
                    continue
                chars = len(tokenizer.decode(ids[1 + low : 1 + (high or len(nll))].tolist()))
                nats = float(nll[low:high].double().sum()) / max(chars, 1)
                span = f"{low // 1000}k-{high // 1000}k" if high else f">{low // 1000}k"
                rows.append(
                    {
                        "measure": "held-out, one stream",
                        "value": round(nats, 4),
                        "unit": "nats/char",
                        "mixer": mixer,
                        "tokens": span,
                    }
                )
                log(f"  aft_local stream, tokens {span}: {nats:.4f} nats/char ({nats / math.log(2):.4f} bits/char)")
    base = {r["unit"]: r["value"] for r in rows if r["mixer"] == BASELINE and r["measure"] == "held-out"}
    for r in rows:
        if r["measure"] == "held-out" and r["unit"] in base:
            r["vs_attention"] = round(r["value"] - base[r["unit"]], 4)  # a difference: lower is better
    return rows


def comparison_targets(rows: list[Row]) -> list[Row]:
    """The issue's targets, checked against the measured ratios (those present)."""

    def ratio(measure: str, **where) -> float | None:
        for r in rows:
            if r["measure"] == measure and r["mixer"] == "aft_local" and all(r.get(k) == v for k, v in where.items()):
                return r.get("vs_attention")
        return None

    checks = [
        (
            "train tokens/s aft_local / attention, T=256",
            ratio("train step", length=256),
            "x",
            ">= 1.0",
            lambda x: x >= 1.0,
        ),
        (
            "train tokens/s aft_local / attention, T=1024",
            ratio("train step", length=1024),
            "x",
            ">= 1.4",
            lambda x: x >= 1.4,
        ),
        (
            "train tokens/s aft_local / attention, T=4096",
            ratio("train step", length=4096),
            "x",
            ">= 2.5",
            lambda x: x >= 2.5,
        ),
        (
            "train peak memory aft_local / attention, T=4096",
            ratio("train peak memory", length=4096),
            "x",
            "<= 0.5",
            lambda x: x <= 0.5,
        ),
        (
            "mixer fwd+bwd time aft_local / attention, T=1024",
            ratio("mixer fwd+bwd", length=1024),
            "x",
            "<= 0.5",
            lambda x: x <= 0.5,
        ),
        (
            "decode latency aft_local / attention, after 32k",
            ratio("decode step", context=32_000),
            "x",
            "<= 0.125",
            lambda x: x <= 0.125,
        ),
        (
            "held-out nats/char, aft_local minus attention",
            ratio("held-out", unit="nats/char"),
            "nats/char",
            "<= 0.03",
            lambda x: x <= 0.03,
        ),
    ]
    memory = [r["value"] for r in rows if r["measure"] == "decode state memory" and r["mixer"] == "aft_local"]
    targets = [
        {"measure": name, "value": value, "unit": unit, "target": goal, "ok": test(value)}
        for name, value, unit, goal, test in checks
        if value is not None
    ]
    if memory:
        growth = memory[-1] - memory[0]
        targets.append(
            {
                "measure": "decode state growth aft_local, 1k -> 32k",
                "value": growth,
                "unit": "MB",
                "target": "== 0",
                "ok": growth == 0,
            }
        )
    return targets


def print_comparison(rows: list[Row], as_json: bool) -> None:
    """JSON rows on stdout, or rich tables: one column per mixer, plus aft_local against attention."""
    if as_json:
        print_rows(rows, True)
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    measured = [r for r in rows if "mixer" in r]
    mixers = list(dict.fromkeys(r["mixer"] for r in measured))
    table = Table(title="aftgen bench: every mixer at the same width and depth")
    for column in ("measure", "at", *mixers, "aft_local vs attention"):
        table.add_column(column, justify="left" if column in ("measure", "at") else "right")
    groups: dict[tuple, dict] = {}
    for r in measured:
        at = next(
            (
                f"{k} {r[k]:,}" if isinstance(r[k], int) else f"{k} {r[k]}"
                for k in ("length", "context", "tokens")
                if k in r
            ),
            "",
        )
        groups.setdefault((f"{r['measure']} ({r['unit']})", at), {})[r["mixer"]] = r
    for (measure, at), by_mixer in groups.items():
        ours = by_mixer.get("aft_local", {}).get("vs_attention")
        versus = "" if ours is None else (f"{ours:+.4f}" if measure.startswith("held-out (") else f"{ours:.2f}x")
        cells = [f"{by_mixer[m]['value']:,.4g}" if m in by_mixer else "" for m in mixers]
        table.add_row(measure, at, *cells, versus)
    console.print(table)
    checks = [r for r in rows if "target" in r]
    if checks:
        verdicts = Table(title="targets")
        for column in ("target", "measured", "goal", ""):
            verdicts.add_column(column)
        for r in checks:
            verdicts.add_row(r["measure"], f"{r['value']:.3g}", r["target"], "ok" if r["ok"] else "MISSED")
        console.print(verdicts)


def pyplot():
    """matplotlib's pyplot, drawing to files only; checked before a benchmark starts, not after it."""
    from aftgen.errors import AftgenError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AftgenError("--plot needs matplotlib: pip install 'aftgen[plot]'") from None
    return plt


def plot_comparison(rows: list[Row], path: Path) -> None:
    """Training speed and memory by length, decode latency by context: one PNG, written atomically."""
    import io

    from aftgen.errors import AftgenError
    from aftgen.files import atomic_write

    plt = pyplot()
    panels = [("train step", "length"), ("train peak memory", "length"), ("decode step", "context")]
    panels = [(m, k) for m, k in panels if any(r["measure"] == m for r in rows)]
    if not panels:
        raise AftgenError("nothing to plot: --plot draws the train and decode rows")
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (measure, key) in zip(axes[0], panels, strict=True):
        chosen = [r for r in rows if r["measure"] == measure]
        for mixer in dict.fromkeys(r["mixer"] for r in chosen):
            points = [(r[key], r["value"]) for r in chosen if r["mixer"] == mixer]
            axis.plot(*zip(*points, strict=True), marker="o", label=mixer)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("sequence length" if key == "length" else "context (tokens)")
        axis.set_ylabel(chosen[0]["unit"])
        axis.set_title(measure)
        axis.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    atomic_write(path, buffer.getvalue())
