"""Every pass/fail target the benchmarks judge, in one table: what is compared, and the bound."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

Row = dict  # {"measure", "value", "unit", ...; "target" and "ok" on judged rows}
RELATIONS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, ">=": operator.ge, "==": operator.eq, "<": operator.lt,
}  # fmt: skip


@dataclass(frozen=True)
class Target:
    measure: str  # the row's label
    unit: str
    relation: str  # "<=", ">=" or "=="
    bound: float

    def judge(self, value: float) -> Row:
        """A row holding `value` and whether it meets the target."""
        meets = RELATIONS[self.relation](value, self.bound)
        goal = f"{self.relation} {self.bound:g}"
        return {"measure": self.measure, "value": round(value, 4), "unit": self.unit, "target": goal, "ok": meets}


SUBJECT, BASELINE = "aft_local", "attention"  # the mixer the comparison targets judge, and against what

TARGETS: dict[str, Target] = {
    # bench generate: the recurrent decoder at batch 1
    "latency growth": Target("latency after 100k / after 1k", "x", "<=", 1.10),
    "memory growth": Target("peak memory growth, 1k -> 100k generated", "MB", "<=", 5),
    "ingestion speed-up": Target("ingestion speed-up per token vs stepping", "x", ">=", 20),
    "step over floor": Target("step latency / floor", "x", "<=", 1.3),  # issue 32: the fused step at its floor
    # bench (all): aft_local against attention at the same width and depth
    "train T=256": Target("train tokens/s aft_local / attention, T=256", "x", ">=", 1.0),
    "train T=1024": Target("train tokens/s aft_local / attention, T=1024", "x", ">=", 1.4),
    "train T=4096": Target("train tokens/s aft_local / attention, T=4096", "x", ">=", 2.5),
    "train memory T=4096": Target("train peak memory aft_local / attention, T=4096", "x", "<=", 0.5),
    "mixer time T=1024": Target("mixer fwd+bwd time aft_local / attention, T=1024", "x", "<=", 0.5),
    "decode after 32k": Target("decode latency aft_local / attention, after 32k", "x", "<=", 0.125),
    "quality": Target("held-out nats/char, aft_local minus attention", "nats/char", "<=", 0.03),
    "decode state growth": Target("decode state growth aft_local, 1k -> 32k", "MB", "==", 0),
    # bench serve: 32 concurrent streams against one, shipped model
    "serve throughput": Target("aggregate tokens/s, 32 streams / 1 stream", "x", ">=", 6),
    "serve latency": Target("ITL p99 at 32 streams / single-stream step (ITL p50 at 1)", "x", "<=", 6),
    "serve memory": Target("peak resident memory growth 1 -> 32 streams, beyond 32 states", "MB", "<=", 50),
    "serve latency spread": Target("ITL p99 / p50 at 32 streams", "x", "<=", 2),  # issue 32: the loop steady
    "serve logprobs": Target("tokens/s at 32 streams, logprobs: 5 on each / free", "x", ">=", 0.9),  # issue 48
    "serve constrained": Target("tokens/s at 32 streams, a JSON schema on each / free", "x", ">=", 0.7),
    "served / ceiling": Target("served tokens/s / the engine's ceiling (no HTTP)", "x", ">=", 0.8),  # each count
    # bench data: preparing 1 GB on 2 cores, and training on it
    "prepare speed": Target("prepare: speed", "MB/s", ">=", round(1000 / 300, 2)),  # 1 GB in 5 minutes
    "prepare memory": Target("prepare: peak RSS", "MB", "<=", 1536),
    "first step": Target("train: start to first step", "s", "<=", 20),
    "train memory": Target("train: peak RSS", "MB", "<=", 1536),
    "prepare memory spread": Target("prepare: peak RSS spread over the corpora", "", "<", 0.10),
    "train memory spread": Target("train: peak RSS spread over the corpora", "", "<", 0.10),
    # bench side-by-side: aftgen jobs together on one machine (cores shared), each against itself alone
    "two trainings together / one alone": Target("two trainings together / one alone, steps/s", "x", ">=", 0.8),
    "training beside a server / alone": Target("training beside a server / alone, steps/s", "x", ">=", 0.35),
    "server beside a training / alone": Target("server beside a training / alone, tokens/s", "x", ">=", 0.35),
    "training alone, shared / every core": Target("training alone, cores shared / every core", "x", ">=", 0.95),
    # bench finetune: 60 s on 50 KB, fine-tuning the shipped model against training from scratch
    "fine-tuning advantage": Target("fine-tuned minus from-scratch held-out, 50 KB, 60 s", "nats/char", ">=", 0.15),
}
