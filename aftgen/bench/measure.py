"""How the benchmarks time and weigh things on a shared machine: side by side, fastest of many rounds."""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import multiprocessing
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from aftgen.device import synchronize
from aftgen.errors import AftgenError
from aftgen.files import KERNEL_FILE_LIMIT, read_text
from aftgen.layers import linear
from aftgen.model import AFTLM, PrefillFunction, StepFunction, clone_state, tokens_read

Timer = tuple[Callable[[], object], int, int]  # (one call, calls per round, tokens per call)
Result = TypeVar("Result")


def memory_mb(pid: int | str | torch.device = "self") -> tuple[float, float]:
    """(resident, peak resident) memory of a process (this one by default) in MB; NaN where unknown.
    A CUDA device instead: this process's (allocated, peak allocated) memory on that GPU."""
    if isinstance(pid, torch.device):
        if pid.type == "cuda":
            return torch.cuda.memory_allocated(pid) / 2**20, torch.cuda.max_memory_allocated(pid) / 2**20
        pid = "self"
    fields = {}
    status = Path(f"/proc/{pid}/status")
    with contextlib.suppress(AftgenError):
        for line in read_text(status, KERNEL_FILE_LIMIT, "a process's status").splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if pid == "self" else math.nan
    peak = fields.get("VmHWM", own)
    return fields.get("VmRSS", peak), peak


def tree_memory_mb(pid: int) -> tuple[float, float]:
    """memory_mb summed over a process and its descendants (`aftgen serve` runs its engine in a child)."""
    figures = [memory_mb(member) for member in _tree(pid)]
    return sum(resident for resident, _ in figures), sum(peak for _, peak in figures)


def _tree(pid: int) -> list[int]:
    try:
        children = read_text(f"/proc/{pid}/task/{pid}/children", KERNEL_FILE_LIMIT, "a process's children").split()
    except AftgenError:  # gone meanwhile
        children = []
    return [pid] + [member for child in children for member in _tree(int(child))]


def in_fresh_process(function: Callable[..., Result], *args) -> Result:
    """function(*args) in a new interpreter: peak resident memory only goes up, so only a fresh
    process tells one configuration's peak from another's."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def fastest_side_by_side(
    timers: dict[str, Timer], rounds: int = 7, device: torch.device | None = None
) -> dict[str, float]:
    """ms per token of each timer: the fastest of `rounds` rounds, the timers taking turns in each round.

    The fastest, not the median: other processes only ever add time. Taking turns: a slow spell of a
    shared machine then hits both sides of a ratio instead of one. Each turn starts with an untimed
    call: the first call after another timer's runs slow on what that one left in the caches. On a
    GPU (`device`), each timing waits for the work it queued.
    """
    device = device or torch.device("cpu")
    best = dict.fromkeys(timers, math.inf)
    with torch.inference_mode():
        for _ in range(rounds):
            for name, (run, calls, tokens) in timers.items():
                run()
                synchronize(device)
                start = time.perf_counter()
                for _ in range(calls):
                    run()
                synchronize(device)
                best[name] = min(best[name], (time.perf_counter() - start) / calls / tokens * 1e3)
    return best


def products_timer(model: AFTLM, tokens: int = 1, calls: int = 60) -> Timer:
    """The model's own matrix products alone, as reading `tokens` tokens at once needs them.

    One token: the matrix-vector products of a step, every Linear plus the tied output layer, bound
    by memory bandwidth (the floor of per-token latency). A chunk: the matrix-matrix products of
    reading a prompt, bound by arithmetic (the ceiling of prompt ingestion); as in AFTLM.prefill,
    the last block's mixer output and MLP, and the output layer, run for the last token alone.
    """
    last_block = set(model.blocks[-1].modules()) - {model.blocks[-1].mixer.qkv}
    linears = [(m, 1 if m in last_block else tokens) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    device = model.embed.weight.device
    inputs = {(rows, lin.in_features): torch.randn(rows, lin.in_features, device=device) for lin, rows in linears}
    hidden = torch.randn(1, model.config.n_embd, device=device)

    def products() -> None:
        for lin, rows in linears:
            linear(inputs[rows, lin.in_features], lin.weight, lin.bias)
        linear(hidden, model.embed.weight)

    return products, max(1, calls // tokens), tokens


def step_timer(step: StepFunction, state, calls: int = 60) -> Timer:
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
    position = tokens_read(state)
    while position < context:
        chunk = ids[:, : min(ids.shape[1], context - position)]
        _, state = model.prefill(chunk, state, last_only=True)
        position += chunk.shape[1]
    return state
