"""The aftgen language model: pre-LayerNorm residual blocks of a token mixer and an MLP, tied embeddings.

Training reads whole sequences through the mixer's parallel form; generation feeds one token at a
time through its step form, carrying a per-layer state whose size never depends on how many tokens
came before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from aftgen.errors import AftgenError
from aftgen.mixer import AFTLocalMixer, AttentionMixer, MixerState

# Token mixers; everything else in the model is shared. The AFT ones differ only in their window s:
# aft_local uses config.window, aft_simple none (no position bias, only the decay), aft_full the whole
# training context (its generation step then costs O(context_length) per token).
MIXERS = ("aft_local", "aft_simple", "aft_full", "attention")

ModelState = list[MixerState]

# Far beyond anything aftgen trains, these keep a hostile or mistyped config.json (or option) from
# asking for terabytes, or for sizes that overflow torch's integers, before any weights are read.
LIMITS = {"vocab_size": 1 << 20, "n_layer": 1024, "n_embd": 1 << 16, "n_head": 1 << 12, "window": 1 << 20,
          "context_length": 1 << 20, "mlp_ratio": 64}  # fmt: skip
MAX_PARAMETERS = 1 << 32  # 16 GiB of fp32 weights


@dataclass
class AFTConfig:
    """Architecture of an aftgen model; stored as config.json beside the weights."""

    vocab_size: int
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    window: int = 32
    context_length: int = 256
    mixer: str = "aft_local"
    decay: bool = True
    dropout: float = 0.0
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise AftgenError naming the first field whose type or range is wrong."""
        for f in fields(self):
            value = getattr(self, f.name)
            expected = {"int": int, "str": str, "bool": bool, "float": (int, float)}[str(f.type)]
            if isinstance(value, bool) and expected is not bool or not isinstance(value, expected):
                raise AftgenError(f"config field '{f.name}' must be {f.type}, got {value!r}")
        positive = ("vocab_size", "n_layer", "n_embd", "n_head", "context_length", "mlp_ratio")
        for name in positive:
            if getattr(self, name) <= 0:
                raise AftgenError(f"config field '{name}' must be positive, got {getattr(self, name)}")
        for name, limit in LIMITS.items():
            if getattr(self, name) > limit:
                raise AftgenError(f"config field '{name}' must be at most {limit}, got {getattr(self, name)}")
        if self.approximate_parameters() > MAX_PARAMETERS:
            raise AftgenError(
                f"this config needs about {self.approximate_parameters():.3g} parameters, more than aftgen's limit of {MAX_PARAMETERS:.3g}"
            )
        if self.n_embd % self.n_head:
            raise AftgenError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0 <= self.window <= self.context_length:
            raise AftgenError(f"window ({self.window}) must be between 0 and context_length ({self.context_length})")
        if self.mixer not in MIXERS:
            raise AftgenError(f"unknown mixer '{self.mixer}'; choose one of: {', '.join(MIXERS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise AftgenError(f"dropout must be in [0, 1), got {self.dropout}")

    def approximate_parameters(self) -> int:
        """Embedding plus the blocks' matrices and position biases (within a few percent)."""
        per_layer = (4 + 2 * self.mlp_ratio) * self.n_embd**2 + self.n_head * self.context_length
        return self.vocab_size * self.n_embd + self.n_layer * per_layer

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> AFTConfig:
        """Build a config from parsed JSON, refusing unknown keys and wrong types."""
        if not isinstance(data, dict):
            raise AftgenError("config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise AftgenError(f"config has unknown keys: {', '.join(unknown)}")
        if "vocab_size" not in data:
            raise AftgenError("config is missing 'vocab_size'")
        return cls(**data)


class MLP(nn.Module):
    def __init__(self, config: AFTConfig):
        super().__init__()
        self.up = nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd)
        self.proj = nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.up(x)))


def make_mixer(config: AFTConfig) -> nn.Module:
    """The token mixer config.mixer names (all share forward(x, state, return_state, last_only) / step / initial_state)."""
    if config.mixer == "attention":
        return AttentionMixer(config.n_embd, config.n_head)
    window = {"aft_local": config.window, "aft_simple": 0, "aft_full": config.context_length}[config.mixer]
    return AFTLocalMixer(config.n_embd, config.n_head, window, config.context_length, config.decay)


class Block(nn.Module):
    def __init__(self, config: AFTConfig):
        super().__init__()
        self.ln_mix = nn.LayerNorm(config.n_embd)
        self.mixer = make_mixer(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, state=None, return_state=False, last_only=False):
        mixed, state = self.mixer(self.ln_mix(x), state, return_state, last_only)
        x = (x[:, -1:] if last_only else x) + self.dropout(mixed)
        return x + self.dropout(self.mlp(self.ln_mlp(x))), state

    def step(self, x, state):
        x = x + self.mixer.step(self.ln_mix(x), state)
        return x + self.mlp(self.ln_mlp(x))


class AFTLM(nn.Module):
    """Causal language model. `model(ids)` gives logits; `prefill`/`step` carry a recurrent state."""

    def __init__(self, config: AFTConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_out = nn.LayerNorm(config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaling of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln_out(x), self.embed.weight)  # tied input/output embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids (B, T), read in parallel from an empty context."""
        x = self.dropout(self.embed(ids))
        for block in self.blocks:
            x, _ = block(x)
        return self._logits(x)

    def initial_state(self, batch_size: int = 1) -> ModelState:
        """The recurrent state before any token, one entry per layer."""
        device = self.embed.weight.device
        return [block.mixer.initial_state(batch_size, device) for block in self.blocks]

    def prefill(
        self, ids: torch.Tensor, state: ModelState | None = None, last_only: bool = False
    ) -> tuple[torch.Tensor, ModelState]:
        """Read ids (B, T) in the parallel form, continuing from `state`; return logits and the new state.

        `last_only` computes logits for the last position alone (B, 1, vocab): reading a prompt needs
        nothing else. The last block then needs every token's keys and values (for the state) but
        its mixer output and MLP for the last token alone (llama.cpp skips them too): in a 4-layer
        model, a fifth of the matrix work per prompt token.
        """
        x = self.embed(ids.to(self.embed.weight.device))  # ids may come from the CPU
        states = state or [None] * len(self.blocks)
        new_states = []
        for depth, (block, layer_state) in enumerate(zip(self.blocks, states, strict=True)):
            x, layer_state = block(
                x, layer_state, return_state=True, last_only=last_only and depth == len(self.blocks) - 1
            )
            new_states.append(layer_state)
        return self._logits(x), new_states

    def step(self, ids: torch.Tensor, state: ModelState) -> tuple[torch.Tensor, ModelState]:
        """Feed one token per sequence, ids (B,); return logits (B, vocab). Updates `state` in place."""
        x = self.embed(ids.to(self.embed.weight.device))
        for block, layer_state in zip(self.blocks, state, strict=True):
            x = block.step(x, layer_state)
        return self._logits(x), state


def clone_state(state: ModelState, repeat: int = 1) -> ModelState:
    """A copy of a state, each sequence repeated `repeat` times along the batch."""
    return [
        {name: t.clone() if t.dim() == 0 else t.repeat_interleave(repeat, dim=0) for name, t in layer.items()}
        for layer in state
    ]


StepFunction = Callable[[torch.Tensor, ModelState], tuple[torch.Tensor, ModelState]]
PrefillFunction = Callable[..., tuple[torch.Tensor, ModelState]]


def _compiled(function: Callable, warm_up: Callable[[Callable], object]) -> tuple[Callable, str]:
    """`function` through torch.compile, warmed up by `warm_up(compiled)`; `function` itself where no compiler works.

    Eager PyTorch spends much of a small model's time in per-op overhead and separate pointwise
    passes; inductor fuses that work into a few C++ kernels around the matrix products. The compile
    (tens of seconds the first time, a few once PyTorch's on-disk cache holds it) is paid here, on
    scratch inputs, so it never lands inside a generation. Returns the function and a note of what happened.
    """
    start = time.perf_counter()
    compiled = torch.compile(function, fullgraph=True, dynamic=False)
    try:
        with torch.inference_mode():  # the mode generation runs in: compiled graphs are specific to it
            warm_up(compiled)
    except Exception as exc:  # no C++ compiler, a mixer that cannot be traced, ...: eager still works
        return function, f"eager (torch.compile failed: {type(exc).__name__})"
    return compiled, f"compiled in {time.perf_counter() - start:.1f} s"


def compile_step(model: AFTLM, batch_size: int = 1) -> tuple[StepFunction, str]:
    """`model.step` compiled for `batch_size` sequences (see _compiled), and a note of what happened."""
    device = model.embed.weight.device
    return _compiled(
        model.step,
        lambda step: step(torch.zeros(batch_size, dtype=torch.long, device=device), model.initial_state(batch_size)),
    )


def compile_prefill(model: AFTLM, length: int) -> tuple[PrefillFunction, str]:
    """`model.prefill` compiled for chunks of exactly `length` tokens at batch 1 continuing a state
    (how long texts are read), and a note of what happened. Use `model.prefill` for other shapes:
    each new shape would compile anew."""
    device = model.embed.weight.device
    ids = torch.zeros(1, length, dtype=torch.long, device=device)

    def warm_up(prefill: Callable) -> None:
        _, state = model.prefill(ids, model.initial_state(1), last_only=True)  # a state like every later one
        prefill(ids, state, last_only=True)

    return _compiled(model.prefill, warm_up)
