"""Generation: the prompt read in the parallel form, then one recurrent step per token.

Sampling controls follow llama.cpp / transformers meanings: temperature (0 = greedy), top-k,
top-p (nucleus), min-p, repeat penalty over the last n tokens, stop strings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from aftgen.errors import AftgenError
from aftgen.model import AFTLM, ModelState, clone_state
from aftgen.tokenizer import Tokenizer


@dataclass
class SamplingOptions:
    max_new_tokens: int = 200  # -1: until stopped
    temperature: float = 0.8
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def check(self) -> None:
        """Refuse values outside their meaning, before any work."""
        if self.max_new_tokens < -1:
            raise AftgenError(f"--max-new-tokens must be -1 (no limit) or >= 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise AftgenError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise AftgenError(f"--top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise AftgenError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise AftgenError(f"--min-p must be in [0, 1), got {self.min_p}")
        if not self.repeat_penalty > 0:
            raise AftgenError(f"--repeat-penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise AftgenError(f"--repeat-last-n must be >= 0, got {self.repeat_last_n}")
        if any(not s for s in self.stop):
            raise AftgenError("--stop strings must not be empty")


def apply_repeat_penalty(logits: torch.Tensor, recent: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty, as llama.cpp applies it: divide positive logits of recent tokens, multiply negative ones."""
    if penalty == 1.0 or recent.numel() == 0:
        return logits
    picked = logits.gather(-1, recent)
    return logits.scatter(-1, recent, torch.where(picked > 0, picked / penalty, picked * penalty))


def filter_logits(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p: tokens ruled out get -inf. logits: (B, V)."""
    logits = logits.float() / options.temperature
    if options.top_k and options.top_k < logits.shape[-1]:
        kth = torch.topk(logits, options.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if options.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest set whose probability reaches top_p: a token goes if the ones before it already do.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= options.top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    if options.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < options.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def choose(logits: torch.Tensor, options: SamplingOptions, history: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The next token for each row of logits (B, V), given each row's token history (B, n)."""
    recent = history[:, -options.repeat_last_n :] if options.repeat_last_n else history[:, :0]
    logits = apply_repeat_penalty(logits.float(), recent, options.repeat_penalty)
    if options.temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits, options).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


class StopFilter:
    """Holds back text that might be the start of a stop string; ends output before a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@torch.inference_mode()
def read_prompt(model: AFTLM, tokenizer: Tokenizer, prompt: str, state: ModelState | None = None) -> tuple[torch.Tensor, ModelState, list[int]]:
    """Ingest a prompt in the parallel form: (logits for the next token (1, V), state, prompt ids).

    A fresh context starts with BOS; a continued one (state given) does not.
    """
    ids = ([] if state is not None else [tokenizer.bos_id]) + tokenizer.encode(prompt)
    if not ids:
        raise AftgenError("nothing to continue from: give a prompt or a state")
    logits, state = model.prefill(torch.tensor([ids]), state)
    return logits[:, -1], state, ids


@torch.inference_mode()
def generate(
    model: AFTLM,
    tokenizer: Tokenizer,
    logits: torch.Tensor,
    state: ModelState,
    options: SamplingOptions,
    history: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[str]:
    """Stream text from next-token logits (1, V) and a state, which is advanced in place.

    Yields only whole characters; ends at max_new_tokens or before a stop string.
    """
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(options.seed if options.seed is not None else torch.seed())
    decoder, stops = tokenizer.stream_decoder(), StopFilter(options.stop)
    window = max(options.repeat_last_n, 1)
    history_ids = torch.tensor([(history or [])[-window:]], dtype=torch.long)
    produced = 0
    while options.max_new_tokens < 0 or produced < options.max_new_tokens:
        token = choose(logits, options, history_ids, generator)
        produced += 1
        history_ids = torch.cat([history_ids, token[:, None]], dim=1)[:, -window:]
        text = stops.feed(decoder.feed(int(token)))
        if text:
            yield text
        if stops.stopped:
            return
        logits, state = model.step(token, state)
    tail = stops.feed(decoder.flush())
    yield tail + ("" if stops.stopped else stops.flush())


def sample_text(
    model: AFTLM,
    tokenizer: Tokenizer,
    prompt: str,
    options: SamplingOptions,
    num_samples: int = 1,
    state: ModelState | None = None,
) -> Iterator[Iterator[str]]:
    """`num_samples` continuations of one prompt; the prompt is read once and its state shared."""
    options.check()
    logits, prompt_state, ids = read_prompt(model, tokenizer, prompt, state)
    generator = torch.Generator()
    generator.manual_seed(options.seed if options.seed is not None else torch.seed())
    for _ in range(num_samples):
        yield generate(model, tokenizer, logits, clone_state(prompt_state), options, ids, generator)
