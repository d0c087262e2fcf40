"""The aftgen language model: pre-LayerNorm residual blocks of a token mixer and an MLP, tied embeddings.

Training reads whole sequences through the mixer's parallel form; generation feeds one token at a
time through its step form, carrying a per-layer state whose size never depends on how many tokens
came before.
"""

from __future__ import annotations

import hashlib
import math
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from aftgen.errors import AftgenError
from aftgen.layers import Linear, linear
from aftgen.mixers import MIXERS, MixerState, make_mixer

ModelState = list[MixerState]  # one mixer state per layer

# Far beyond anything aftgen trains, these keep a hostile or mistyped config.json (or option) from
# asking for terabytes, or for sizes that overflow torch's integers, before any weights are read.
LIMITS = {"vocab_size": 1 << 20, "n_layer": 1024, "n_embd": 1 << 16, "n_head": 1 << 12, "window": 1 << 20,
          "context_length": 1 << 20, "mlp_ratio": 64}  # fmt: skip
MAX_PARAMETERS = 1 << 32  # 16 GiB of fp32 weights

# The MLP's nonlinearity. ReLU squared (So et al. 2021, "Primer"; modded-nanogpt) with weight decay 1.0 learns
# faster on small corpora (docs/recipe.md), so the training recipe chooses it. GELU is GPT-2's: a config.json
# without "activation" (every model trained before the recipe chose ReLU squared, the shipped one too) is GELU.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu2": lambda x: F.relu(x).square(),
}


class Dropout(nn.Module):
    """nn.Dropout with a cheaper mask on a CPU, where torch's bernoulli_ draws one number per element: nine of them
    took about a third of the small preset's training step. Each 64-bit draw here gives four 16-bit ones (p is
    rounded to a multiple of 1/65536), from the same seeded generator, so a resumed run is still exact."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, training=True)
        count = x.numel()
        bits = torch.randint(-(2**63), 2**63 - 1, ((count + 3) // 4,), dtype=torch.int64)
        kept = bits.view(torch.int16)[:count].view(x.shape) >= round(self.p * 65536) - 32768
        return x * kept.to(x.dtype).mul_(1 / (1 - self.p))


# Model sizes (and the batch size that suits them), among which training's recipe chooses for the corpus
# and the budget (aftgen/training/recipe.py). "tiny" is for tests; "medium" is the shipped model (under
# 16 MB in fp16); "large" is for large corpora and GPUs.
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_embd=32, n_head=2, window=8, context_length=32, batch_size=8),
    "small": dict(n_layer=4, n_embd=192, n_head=6, window=32, context_length=128, batch_size=16),
    "medium": dict(n_layer=6, n_embd=320, n_head=10, window=32, context_length=256, batch_size=16),
    "large": dict(n_layer=8, n_embd=512, n_head=16, window=64, context_length=512, batch_size=32),
}


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
    activation: str = "gelu"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise AftgenError naming the first field whose type or range is wrong."""
        for name, annotation in typing.get_type_hints(AFTConfig).items():
            if not _is_a(getattr(self, name), annotation):
                wanted, got = _type_name(annotation), getattr(self, name)
                raise AftgenError(f"config field '{name}' must be {wanted}, got {got!r}")
        positive = ("vocab_size", "n_layer", "n_embd", "n_head", "context_length", "mlp_ratio")
        for name in positive:
            if getattr(self, name) <= 0:
                raise AftgenError(f"config field '{name}' must be positive, got {getattr(self, name)}")
        for name, limit in LIMITS.items():
            if getattr(self, name) > limit:
                raise AftgenError(f"config field '{name}' must be at most {limit}, got {getattr(self, name)}")
        if self.approximate_parameters() > MAX_PARAMETERS:
            raise AftgenError(
                f"this config needs about {self.approximate_parameters():.3g} parameters, "
                f"more than aftgen's limit of {MAX_PARAMETERS:.3g}"
            )
        if self.n_embd % self.n_head:
            raise AftgenError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0 <= self.window <= self.context_length:
            raise AftgenError(f"window ({self.window}) must be between 0 and context_length ({self.context_length})")
        if self.mixer not in MIXERS:
            raise AftgenError(f"unknown mixer '{self.mixer}'; choose one of: {', '.join(MIXERS)}")
        if self.activation not in ACTIVATIONS:
            raise AftgenError(f"unknown activation '{self.activation}'; choose one of: {', '.join(ACTIVATIONS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise AftgenError(f"dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_preset(cls, preset: str, vocab_size: int, **changes) -> AFTConfig:
        """A preset's sizes (less its batch size), with `changes` laid over them."""
        if preset not in PRESETS:
            raise AftgenError(f"unknown preset '{preset}'; choose one of: {', '.join(PRESETS)}")
        sizes = {name: value for name, value in PRESETS[preset].items() if name != "batch_size"}
        return cls(vocab_size=vocab_size, **sizes | changes)

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


def _is_a(value: object, annotation: object) -> bool:
    """Whether a parsed JSON value fits a field's annotation (int | None, float, ...); bools are not numbers."""
    accepted = typing.get_args(annotation) or (annotation,)
    if isinstance(value, bool):
        return bool in accepted
    return isinstance(value, accepted) or (float in accepted and isinstance(value, int))


def _type_name(annotation: object) -> str:
    return " or ".join(getattr(t, "__name__", str(t)) for t in typing.get_args(annotation) or (annotation,))


class MLP(nn.Module):
    def __init__(self, config: AFTConfig):
        super().__init__()
        self.up = Linear(config.n_embd, config.mlp_ratio * config.n_embd)
        self.proj = Linear(config.mlp_ratio * config.n_embd, config.n_embd)
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.activation(self.up(x)))


class Block(nn.Module):
    def __init__(self, config: AFTConfig):
        super().__init__()
        self.ln_mix = nn.LayerNorm(config.n_embd)
        self.mixer = make_mixer(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)
        self.dropout = Dropout(config.dropout)

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
        self.trained_sha256: str | None = None  # set once generation stores the matrices lower
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_out = nn.LayerNorm(config.n_embd)
        self.dropout = Dropout(config.dropout)
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

    def decayed_parameters(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(parameters AdamW should decay, the rest): matrices, less those the mixers exempt (position biases)."""
        exempt = {id(getattr(b.mixer, name)) for b in self.blocks for name in b.mixer.no_weight_decay}
        decayed = [p for p in self.parameters() if p.dim() >= 2 and id(p) not in exempt]
        kept = {id(p) for p in decayed}
        return decayed, [p for p in self.parameters() if id(p) not in kept]

    def weights_sha256(self) -> str:
        """SHA-256 over every tensor's name, dtype, shape and bytes, in name order, as trained: a model whose
        matrices generation stored lower keeps the hash it had (a state file names its model by it)."""
        if self.trained_sha256 is not None:
            return self.trained_sha256
        digest = hashlib.sha256()
        for name, tensor in sorted(self.state_dict().items()):
            tensor = tensor.detach().cpu().contiguous()
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        return digest.hexdigest()

    def lower_weights(self, dtype: torch.dtype) -> AFTLM:
        """Store the matrices (the weight of every aftgen.layers.Linear and the tied embedding) in `dtype`, for
        generation (aftgen.layers says why); the rest stays float32, as do the layers of a mixer registered from
        outside, which multiply in their own way. Returns the model, changed in place."""
        if dtype != torch.float32 and self.trained_sha256 is None:
            self.trained_sha256 = self.weights_sha256()
        for module in self.modules():
            if isinstance(module, (Linear, nn.Embedding)) and module.weight.dtype != dtype:
                module.weight = nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
        return self

    def _embedded(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of ids, in float32 however the table is stored; ids may come from the CPU."""
        return self.embed(ids.to(self.embed.weight.device)).float()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.ln_out(x), self.embed.weight)  # tied input/output embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids (B, T), read in parallel from an empty context."""
        x = self.dropout(self._embedded(ids))
        for block in self.blocks:
            x, _ = block(x)
        return self._logits(x)

    def initial_state(self, batch_size: int = 1) -> ModelState:
        """The recurrent state before any token, one entry per layer."""
        device = self.embed.weight.device
        return [block.mixer.initial_state(batch_size, device) for block in self.blocks]

    @torch.no_grad()  # the inference API: no gradient flows through a carried state (training uses forward)
    def prefill(
        self, ids: torch.Tensor, state: ModelState | None = None, last_only: bool = False
    ) -> tuple[torch.Tensor, ModelState]:
        """Read ids (B, T) in the parallel form, continuing from `state`; return logits and the new state.

        `last_only` computes logits for the last position alone (B, 1, vocab): reading a prompt needs
        nothing else. The last block then needs every token's keys and values (for the state) but
        its mixer output and MLP for the last token alone (llama.cpp skips them too).
        """
        x = self._embedded(ids)
        states = state or [None] * len(self.blocks)
        new_states = []
        for depth, (block, layer_state) in enumerate(zip(self.blocks, states, strict=True)):
            x, layer_state = block(
                x, layer_state, return_state=True, last_only=last_only and depth == len(self.blocks) - 1
            )
            new_states.append(layer_state)
        return self._logits(x), new_states

    @torch.no_grad()
    def step(self, ids: torch.Tensor, state: ModelState) -> tuple[torch.Tensor, ModelState]:
        """Feed one token per sequence, ids (B,); return logits (B, vocab). Updates `state` in place."""
        x = self._embedded(ids)
        for block, layer_state in zip(self.blocks, state, strict=True):
            x = block.step(x, layer_state)
        return self._logits(x), state


def clone_state(state: ModelState) -> ModelState:
    """An independent copy of a state."""
    return [{name: tensor.clone() for name, tensor in layer.items()} for layer in state]


def tokens_read(state: ModelState) -> int:
    """How many tokens a batch-1 state has read (every layer has read the same)."""
    return int(state[0]["position"])  # (1,), or 0-dim in a state that is never batched (attention's)


StepFunction = Callable[[torch.Tensor, ModelState], tuple[torch.Tensor, ModelState]]
PrefillFunction = Callable[..., tuple[torch.Tensor, ModelState]]
