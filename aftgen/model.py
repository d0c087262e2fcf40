"""The aftgen language model: pre-LayerNorm residual blocks of a token mixer and an MLP, tied embeddings.

Training reads whole sequences through the mixer's parallel form; generation feeds one token at a
time through its step form, carrying a per-layer state whose size never depends on how many tokens
came before.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import operator
import os
import sys
import time
import typing
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from aftgen import rowdot
from aftgen.aoti import PackageRunner, UnlockedRunner
from aftgen.compiled_cache import cached_package, compiled_folder
from aftgen.device import Compiled, failure_line
from aftgen.errors import AftgenError
from aftgen.files import atomic_open, own_source
from aftgen.layers import ROWDOT, WRITTEN, Linear, invariant_products, linear, written_products
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


def use_persistent_compile_cache() -> None:
    """Keep PyTorch's compile caches (inductor's FX graph and AOTAutograd caches) in compiled_folder(), so
    a second start compiles in seconds; a TORCHINDUCTOR_CACHE_DIR already set wins."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compiled_folder() / "torch"))


def _compiled(function: Callable, warm_up: Callable[[Callable], object]) -> tuple[Callable, str]:
    """`function` compiled into fused kernels and warmed up by `warm_up(compiled)`, or `function` itself
    where no compiler works; and a note of what happened.

    The compile (tens of seconds the first time, a few once PyTorch's on-disk cache holds it) is
    paid here, on scratch inputs, so it never lands inside a generation.
    """
    use_persistent_compile_cache()
    start = time.perf_counter()
    compiled = Compiled(function, fullgraph=True, dynamic=False)
    with torch.inference_mode():  # the mode generation runs in: compiled graphs are specific to it
        warm_up(compiled)
    if compiled.failure is not None:
        return function, f"eager (torch.compile failed: {compiled.failure})"
    compiled.warn = _said_on_stderr  # a later compile that fails (a shape not warmed up on) falls back, said
    return compiled, f"compiled in {time.perf_counter() - start:.1f} s"


def _said_on_stderr(failure: str) -> None:
    print(f"warning: torch.compile failed, running eagerly: {failure}", file=sys.stderr, flush=True)


# The step is compiled ahead of time (torch.export, then AOTInductor) rather than through torch.compile:
# a step is a millisecond, and torch.compile's guards and Python wrappers cost a third of one beside the
# step's own matrix-vector products (its floor); a package's C++ runner costs a tenth. The package holds no
# weights: it reads the model's own as constants handed to it once (aftgen.aoti), and serves every model of
# the architecture. So no weight may be written into its code, as the compiler would a small one.
STEP_PACKAGE_CONFIG = {
    "reorder_for_locality": False,
    "aot_inductor.package_constants_in_so": False,
    "always_keep_tensor_constants": True,
}
# How the fused kernels use threads. A batch's take torch's thread count when they run, not when they were
# compiled: they follow aftgen.cores' share. A single row's work between its products (a few hundred numbers
# a kernel) is shorter than waking a second thread: its kernels run on one, its products on torch's threads.
# So do the batch-invariant package's, whose products (aftgen.rowdot) run on one thread: one package serves
# every batch, and at one row its kernels on one thread took 0.27 ms a step against 0.33 with torch's (one
# torch thread, the shipped model), the same at 32 rows.
STEP_THREADS = {"rows": {"cpp.dynamic_threads": True}, "one thread": {"cpp.threads": 1}}
WRITTEN_CONFIG = {"emulate_precision_casts": True}  # written-out products round to bf16 where the matrix kernels do
# The kinds of step package: the matrix kernels' (a batch's); a single row's with its products written out, for
# weights stored lower (faster than the bf16 kernels at one row); and the batch-invariant one (aftgen.layers).
KERNELS, ONE_ROW_WRITTEN, BATCH_INVARIANT = "kernels", "one row written out", "batch-invariant"
STEP_PACKAGE_FORMAT = 4  # bump when what a package holds or takes changes (4: a position per row)
# The batch-invariant step (`compile_step(..., batch_invariant=True)`): one package serves 1 to MAX_ROWS rows
# (aftgen.serve.options: --parallel at most), so every server and `aftgen sample --compile --batch-invariant`
# run the same code, and a row's logits are the same in each, alone or among others (aftgen.layers).
MAX_ROWS = 4096
EXAMPLE_ROWS = 32  # the batch that package is exported with, its kernels tuned for (aftgen serve's default)


def _weights(model: AFTLM) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


class _Step(nn.Module):
    """What torch.export sees: the step as a function of the token ids and the state, its logits out (the
    state is updated in place); the model's weights are the program's constants."""

    def __init__(self, model: AFTLM):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, state: ModelState) -> torch.Tensor:
        return self.model.step(ids, state)[0]


class CompiledStep:
    """`model.step` through compiled packages for batches of 1 to `max_batch` sequences (`one_row` for a
    single one, `rows` for the rest; the same runner where one package serves all); any other batch, or a
    state whose tensors are not laid out as `initial_state` lays them out, steps eagerly."""

    def __init__(self, model: AFTLM, one_row: PackageRunner, rows: PackageRunner, max_batch: int):
        self.model, self.max_batch = model, max_batch
        self.device = model.embed.weight.device
        self.names = list(model.initial_state(1)[0])  # the package's inputs: the ids, then each layer's in this order
        self.one_row, self.rows = one_row, rows  # the packages' runners, called directly: no pytree per token
        self.checked: list[torch.Tensor] = []  # the last inputs found laid out as the packages take them

    def __call__(self, ids: torch.Tensor, state: ModelState) -> tuple[torch.Tensor, ModelState]:
        ids = ids.to(self.device, torch.long).contiguous()
        inputs = [ids, *(layer[name] for layer in state for name in self.names)]
        if not self._laid_out(inputs):
            return self.model.step(ids, state)
        run = self.one_row if ids.shape[0] == 1 else self.rows
        return run(inputs)[0], state

    def _laid_out(self, inputs: list[torch.Tensor]) -> bool:
        """Whether the package can read `inputs`' raw memory: the shapes and strides it was compiled for.
        Checked once for a state that stays the same tensors from token to token (in place, as the step keeps it)."""
        batch = inputs[0].shape[0]
        if len(inputs) == len(self.checked) and batch == self.checked[0].shape[0]:
            if all(map(operator.is_, inputs[1:], self.checked[1:])):
                return True
        if not 1 <= batch <= self.max_batch or not all(
            t.is_contiguous() and (t.dim() == 0 or t.shape[0] == batch) for t in inputs
        ):
            return False
        self.checked = inputs
        return True


def compile_step(model: AFTLM, max_batch: int = 1, batch_invariant: bool = False) -> tuple[StepFunction, str]:
    """`model.step` compiled for every batch size from 1 to `max_batch` (CompiledStep), or `model.step`
    itself where no compiler works; and a note of what happened. `batch_invariant`: a row's logits are the
    same bits whatever rows share its step (its products through aftgen.rowdot on a CPU, written out on a GPU).

    The first compile of a model's architecture (tens of seconds) is kept in aftgen's cache folder; later
    ones, in this process or the next, load it in well under a second. Compile once, before generating,
    inside the autocast the step will run in (Placement.autocast()): the compiled step keeps its dtypes.
    """
    start = time.perf_counter()
    try:
        step, origin = _compiled_step(model, max_batch, batch_invariant)
    except Exception as exc:  # no C++ compiler, a device or op the exporter cannot handle: eager always works
        return model.step, f"eager (compiling the step failed: {failure_line(exc)})"
    return step, f"compiled{origin} in {time.perf_counter() - start:.1f} s"


def _compiled_step(model: AFTLM, max_batch: int, batch_invariant: bool) -> tuple[CompiledStep, str]:
    """The packages for 1 to `max_batch` rows, and " (from the cache)" where the cache had them all: one for 1
    to MAX_ROWS whose products sum each row in one order (batch-invariant: _products); else the matrix
    kernels' package, and with weights stored lower than float32 (aftgen.layers) a second for a single row,
    its products written out (faster than the bf16 kernels at one row)."""
    if batch_invariant:
        run, origin = _step_runner(model, MAX_ROWS, BATCH_INVARIANT)
        return CompiledStep(model, run, run, max_batch), origin
    rows, origin = _step_runner(model, max_batch, KERNELS)
    if max_batch == 1 or model.embed.weight.dtype == torch.float32:
        return CompiledStep(model, rows, rows, max_batch), origin
    one_row, one_row_origin = _step_runner(model, 1, ONE_ROW_WRITTEN)
    return CompiledStep(model, one_row, rows, max_batch), origin if origin == one_row_origin else ""


def _step_runner(model: AFTLM, max_batch: int, kind: str) -> tuple[PackageRunner, str]:
    """The runner of the model's step package for 1 to `max_batch` rows, and " (from the cache)" where the
    cache had the package. On a CPU it runs without Python's lock (aftgen.aoti)."""
    if _products(model, kind) == ROWDOT:  # the package calls the product's library: loaded first, symbols global
        rowdot.library()
    path, origin = step_package(model, max_batch, kind)
    runner = UnlockedRunner if model.embed.weight.device.type == "cpu" else loaded_runner
    return runner(path, step_constants(model)), origin


def step_package(model: AFTLM, max_batch: int, kind: str = KERNELS) -> tuple[Path, str]:
    """The path of the model's step package of `kind` for 1 to `max_batch` rows, compiled now unless the cache
    has it intact (aftgen.compiled_cache); and " (from the cache)" where it did."""
    use_persistent_compile_cache()
    path = compiled_folder() / f"step-{_step_key(model, max_batch, kind)}.pt2"
    return cached_package(path, functools.partial(_package_step, model, max_batch, kind))


def step_constants(model: AFTLM) -> dict[str, torch.Tensor]:
    """The model's weights by the names a step package knows them by (_Step's)."""
    return {f"model.{name}": tensor for name, tensor in _weights(model).items()}


def loaded_runner(path: Path, constants: dict[str, torch.Tensor]) -> PackageRunner:
    """The runner of the package at `path` through torch's loader, reading `constants` in place. It holds
    Python's lock as it runs: for a GPU, whose step only queues kernels."""
    package = torch._inductor.aoti_load_package(str(path))
    package.load_constants({name: constants[name] for name in package.get_constant_fqns()},
                           check_full_update=True, user_managed=True)  # fmt: skip
    return package.loader.boxed_run


def _package_step(model: AFTLM, max_batch: int, kind: str, path: Path) -> None:
    """Export the step for 1 to `max_batch` rows (one graph with a dynamic batch size, or batch 1 alone) and
    compile it into a package at `path` (in a private folder: aftgen.compiled_cache copies it into the cache)."""
    example = min(max_batch, EXAMPLE_ROWS)
    ids = torch.zeros(example, dtype=torch.long, device=model.embed.weight.device)
    state, shapes = model.initial_state(example), None
    if max_batch > 1:
        rows = torch.export.Dim("rows", min=1, max=max_batch)
        per_layer = [{name: {0: rows} if t.dim() else None for name, t in layer.items()} for layer in state]
        shapes = ({0: rows}, per_layer)
    with warnings.catch_warnings(), _numerics(_products(model, kind)), atomic_open(path) as handle:
        # torch's own pytree code trips torch's own deprecation (2.13): a warning no user can act on
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
        program = torch.export.export(_Step(model), (ids, state), dynamic_shapes=shapes)
        configs = _package_configs(model, max_batch, kind) | _shims(model, kind)
        torch._inductor.aoti_compile_and_package(program, package_path=handle, inductor_configs=configs)


def _products(model: AFTLM, kind: str) -> str:
    """How a package of `kind` multiplies: through the matrix kernels, written out (a single row's, for
    speed; a GPU's batch-invariant one), or through aftgen.rowdot (a CPU's batch-invariant one)."""
    if kind == KERNELS:
        return KERNELS
    return ROWDOT if kind == BATCH_INVARIANT and model.embed.weight.device.type == "cpu" else WRITTEN


def _package_configs(model: AFTLM, max_batch: int, kind: str) -> dict:
    """The compiler's settings for a package of 1 to `max_batch` rows (a new dict: the compiler adds to it)."""
    products = _products(model, kind)
    threads = STEP_THREADS["one thread" if max_batch == 1 or products == ROWDOT else "rows"]
    return STEP_PACKAGE_CONFIG | threads | (WRITTEN_CONFIG if products == WRITTEN else {})


def _shims(model: AFTLM, kind: str) -> dict:
    """How a package of `kind` calls aftgen's own C functions (aftgen.rowdot: the batch-invariant product)."""
    if _products(model, kind) != ROWDOT:
        return {}
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.aftgen.rowdot.default: [rowdot.SHIM]}}


def _numerics(products: str) -> contextlib.AbstractContextManager:
    """Tracing a package whose products are `products` (_products)."""
    return {WRITTEN: written_products, ROWDOT: invariant_products}.get(products, contextlib.nullcontext)()


def _step_key(model: AFTLM, max_batch: int, kind: str) -> str:
    """What a compiled step depends on: the architecture, the batch range, the step's code, torch, the
    machine's instruction set or GPU, autocast, the weights' dtype and how it calls aftgen.rowdot. Not the
    weights: the package is handed them when it is loaded."""
    device = model.embed.weight.device
    autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else torch.backends.cpu.get_cpu_capability()
    configs = _package_configs(model, max_batch, kind)
    facts = [STEP_PACKAGE_FORMAT, model.config.to_dict(), max_batch, str(device), hardware, str(autocast),
             str(model.embed.weight.dtype), torch.__version__, kind, configs, rowdot.SHIM]  # fmt: skip
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
    here = Path(__file__).parent
    for source in sorted([Path(__file__), here / "layers.py", *here.glob("mixers/*.py")]):  # the code the step runs
        digest.update(own_source(source))
    return digest.hexdigest()[:20]


def compile_prefill(model: AFTLM, length: int) -> tuple[PrefillFunction, str]:
    """`model.prefill` compiled for chunks of exactly `length` tokens at batch 1 continuing a state
    (how long texts are read), and a note of what happened. Use `model.prefill` for other shapes:
    each new shape would compile anew."""
    ids = torch.zeros(1, length, dtype=torch.long, device=model.embed.weight.device)

    def warm_up(prefill: Callable) -> None:
        _, state = model.prefill(ids, model.initial_state(1), last_only=True)  # a state like every later one
        prefill(ids, state, last_only=True)

    return _compiled(model.prefill, warm_up)
