"""The model's step compiled ahead of time: torch.export, then AOTInductor, into a package kept in aftgen's cache.

`compile_step` gives `model.step` through the packages (CompiledStep) for a batch range, or `model.step` itself
where no compiler works, with a note of which. A package holds no weights (aftgen.compiled.aoti hands it the
model's own), so one serves every model of an architecture; its cache key (_step_key) is everything else it
depends on. The batch-invariant kind multiplies through aftgen.native.matmul_rows (aftgen.layers says why).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import operator
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from aftgen.compiled.aoti import PackageRunner, UnlockedRunner
from aftgen.compiled.availability import STEP, decide
from aftgen.compiled.cache import cached_package, compiled_folder, use_persistent_compile_cache
from aftgen.files import atomic_open, own_source
from aftgen.layers import ROWS_APART, WRITTEN, invariant_products, written_products
from aftgen.model import AFTLM, ModelState, StepFunction
from aftgen.native import library, matmul_rows

# The step is compiled ahead of time (torch.export, then AOTInductor) rather than through torch.compile:
# a step is a millisecond, and torch.compile's guards and Python wrappers cost a third of one beside the
# step's own matrix-vector products (its floor); a package's C++ runner costs a tenth. The package holds no
# weights: it reads the model's own as constants handed to it once (aftgen.compiled.aoti), and serves every model of
# the architecture. So no weight may be written into its code, as the compiler would a small one.
STEP_PACKAGE_CONFIG = {
    "reorder_for_locality": False,
    "aot_inductor.package_constants_in_so": False,
    "always_keep_tensor_constants": True,
}
# How the fused kernels use threads. A batch's take torch's thread count when they run, not when they were
# compiled: they follow aftgen.cores' share. A single row's work between its products (a few hundred numbers
# a kernel) is shorter than waking a second thread: its kernels run on one, its products on torch's threads.
# So do the batch-invariant package's, whose products (aftgen.native.matmul_rows) run on one thread: one package serves
# every batch, and at one row its kernels on one thread were faster than with torch's (one torch thread, the
# shipped model), and no slower at 32 rows (figures: docs/benchmarks.md).
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
    same bits whatever rows share its step (its products through matmul_rows on a CPU, written out on a GPU).

    The first compile of a model's architecture (tens of seconds) is kept in aftgen's cache folder; later
    ones, in this process or the next, load it in well under a second. Compile once, before generating,
    inside the autocast the step will run in (Placement.autocast()): the compiled step keeps its dtypes.
    """
    start = time.perf_counter()
    # no C++ compiler, a device or op the exporter cannot handle: eager always works, and one line says why
    made, verdict = decide(STEP, lambda: _compiled_step(model, max_batch, batch_invariant), "the eager step runs")
    if made is None:
        return model.step, f"eager (compiling the step failed: {verdict.reason})"
    step, origin = made
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
    cache had the package. On a CPU it runs without Python's lock (aftgen.compiled.aoti)."""
    if _products(model, kind) == ROWS_APART:  # the package calls the native library: loaded first, symbols global
        library.library()
    path, origin = step_package(model, max_batch, kind)
    runner = UnlockedRunner if model.embed.weight.device.type == "cpu" else loaded_runner
    return runner(path, step_constants(model)), origin


def step_package(model: AFTLM, max_batch: int, kind: str = KERNELS) -> tuple[Path, str]:
    """The path of the model's step package of `kind` for 1 to `max_batch` rows, compiled now unless the cache
    has it intact (aftgen.compiled.cache); and " (from the cache)" where it did."""
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
    compile it into a package at `path` (in a private folder: aftgen.compiled.cache copies it into the cache)."""
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
    speed; a GPU's batch-invariant one), or through aftgen.native.matmul_rows (a CPU's batch-invariant one)."""
    if kind == KERNELS:
        return KERNELS
    return ROWS_APART if kind == BATCH_INVARIANT and model.embed.weight.device.type == "cpu" else WRITTEN


def _package_configs(model: AFTLM, max_batch: int, kind: str) -> dict:
    """The compiler's settings for a package of 1 to `max_batch` rows (a new dict: the compiler adds to it)."""
    products = _products(model, kind)
    threads = STEP_THREADS["one thread" if max_batch == 1 or products == ROWS_APART else "rows"]
    return STEP_PACKAGE_CONFIG | threads | (WRITTEN_CONFIG if products == WRITTEN else {})


def _shims(model: AFTLM, kind: str) -> dict:
    """How a package of `kind` calls aftgen's own C functions (the batch-invariant product, matmul_rows)."""
    if _products(model, kind) != ROWS_APART:
        return {}
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.aftgen.matmul_rows.default: [matmul_rows.SHIM]}}


def _numerics(products: str) -> contextlib.AbstractContextManager:
    """Tracing a package whose products are `products` (_products)."""
    return {WRITTEN: written_products, ROWS_APART: invariant_products}.get(products, contextlib.nullcontext)()


def _step_key(model: AFTLM, max_batch: int, kind: str) -> str:
    """What a compiled step depends on: the architecture, the batch range, the step's code, torch, the
    machine's instruction set or GPU, autocast, the weights' dtype and how it calls aftgen.native.matmul_rows. Not the
    weights: the package is handed them when it is loaded."""
    device = model.embed.weight.device
    autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else torch.backends.cpu.get_cpu_capability()
    configs = _package_configs(model, max_batch, kind)
    facts = [STEP_PACKAGE_FORMAT, model.config.to_dict(), max_batch, str(device), hardware, str(autocast),
             str(model.embed.weight.dtype), torch.__version__, kind, configs, matmul_rows.SHIM]  # fmt: skip
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
    package = Path(__file__).parents[1]
    code = [Path(__file__), package / "model.py", package / "layers.py", *package.glob("mixers/*.py")]
    for source in sorted(code):  # the code the step runs
        digest.update(own_source(source))
    return digest.hexdigest()[:20]
