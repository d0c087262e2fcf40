"""The batch-invariant matrix product: y = x @ wᵀ with every output summed in one order, however many rows x has.

The matrix libraries' kernels change how they split and order a product's sums with the number of rows (MKL's
float32 ones for any batch, oneDNN's bf16 ones past 32 rows), so the same row rounds differently alone and in a
batch, and a seeded request's text would depend on the requests beside it. rowdot.cpp sums output (m, n) from
row m of x and row n of w alone, in an order fixed by the machine and w's shape:

- with bf16 weights on a CPU with AMX, C^T = w xᵀ in 16 x 16 tiles, w's rows read in place as the tiles' A
  operand (no packing) and x rounded to bf16. Faster than the libraries at 1 row and at 32 (docs/benchmarks.md);
- otherwise 16 partial sums an output, input k into sum k mod 16, then a fixed tree, in register blocks of the
  machine's width (AVX-512, AVX2 or 128-bit): about MKL's float32 speed at 32 rows.

Its products run on one thread, as the batch-invariant step's other kernels do (aftgen.compiled.step.STEP_THREADS).
The library also holds the serving step's scores for `logprobs` (top_scores.cpp, through top_scores here) and the
HTTP side's JSON of them (score_json.cpp, through ScoreJSON).

It is built with the C++ compiler that compiles the step (Inductor's) into aftgen's cache on first use, a
second or two, and loaded with its symbols global: a step package calls `aoti_torch_cpu_rowdot` through
AOTInductor's custom-op shims (SHIM), and eager code through `torch.ops.aftgen.rowdot`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

import torch

from aftgen.compiled.cache import cached_library, compiled_folder
from aftgen.errors import AftgenError
from aftgen.files import own_source, shown

SOURCES = tuple(Path(__file__).with_name(name) for name in ("rowdot.cpp", "top_scores.cpp", "score_json.cpp"))
# How a step package calls it (AOTInductor's custom-op shims): the C declaration of rowdot.cpp's entry point.
SHIM = "AOTITorchError aoti_torch_cpu_rowdot(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0)"
# No -march: the kernel is chosen as it runs. -fno-trapping-math lets top_scores' clamps become vector max/min (no
# figure changes: it only lets floating-point exceptions, which nothing here reads, go unraised).
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math"]
BUILD_TIMEOUT = 300  # seconds: a compiler that hangs is not waited for


class RowdotUnavailable(AftgenError):
    """The product's library cannot be built here (no C++ compiler, or it failed): the message says why."""


UNIT, RECORD = "\x1f", "\x1e"  # score_json.cpp's separators: JSON escapes both inside its strings
SCORE_PIECE = 1024  # tokens ScoreJSON shows in one call


class _Names(ctypes.Structure):
    """score_json.cpp's Names: a tokenizer's names and chat entries, made JSON, as one blob each with offsets."""

    _fields_ = [("text", ctypes.c_char_p), ("at", ctypes.POINTER(ctypes.c_int64)), ("entries", ctypes.c_char_p),
                ("entry_at", ctypes.POINTER(ctypes.c_int64)), ("first", ctypes.POINTER(ctypes.c_int32)),
                ("vocab", ctypes.c_int64)]  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL:
    """The product's library, built into aftgen's cache if it is not there intact, and loaded with its symbols
    global (step packages resolve `aoti_torch_cpu_rowdot` from it)."""
    loaded = ctypes.CDLL(str(library_path()), mode=ctypes.RTLD_GLOBAL)
    loaded.aftgen_rowdot.restype = None
    loaded.aftgen_rowdot.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    loaded.aftgen_rowdot_kernel.restype = ctypes.c_char_p
    loaded.aftgen_rowdot_kernel.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    loaded.aftgen_top_scores.restype = ctypes.c_int
    loaded.aftgen_top_scores.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                         ctypes.c_int, ctypes.c_void_p]  # fmt: skip
    # The HTTP side's calls, a microsecond or two each, keep the GIL (PyDLL's functions): CDLL's let it go for the
    # call, and on a busy server taking it back waited on the server's other threads longer than the call took.
    holding = ctypes.PyDLL(loaded._name, handle=loaded._handle)
    loaded.aftgen_score_json, loaded.aftgen_format_figure = holding.aftgen_score_json, holding.aftgen_format_figure
    loaded.aftgen_score_json.restype = ctypes.c_int64
    loaded.aftgen_score_json.argtypes = [ctypes.POINTER(_Names), ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_char_p, ctypes.c_int64]  # fmt: skip
    loaded.aftgen_format_figure.restype = ctypes.c_int
    loaded.aftgen_format_figure.argtypes = [ctypes.c_float, ctypes.c_char_p]
    for name in ("aftgen_top_scores_most", "aftgen_top_scores_levels"):
        getattr(loaded, name).restype, getattr(loaded, name).argtypes = ctypes.c_int, []
    # asked once: a foreign call costs the engine a microsecond or two at every step
    loaded.top_scores_most, loaded.top_scores_levels = (
        loaded.aftgen_top_scores_most(),
        loaded.aftgen_top_scores_levels(),
    )
    return loaded


def library_path() -> Path:
    """The library in aftgen's cache as built and recorded: built now where it is missing or differs from its
    record (aftgen.compiled.cache), with a line saying so where it was damaged."""
    return cached_library(compiled_folder() / f"rowdot-{_key()}.so", _build)[0]


def bf16_tiles() -> bool:
    """Whether bf16 weights multiply in AMX tiles here (else widened to float32 as they are read)."""
    return library().aftgen_rowdot_kernel(True, 16, 32) == b"amx"


def kernel(weight: torch.Tensor) -> str:
    """The kernel a weight (N, K) goes through on this machine: "amx" or "vector"."""
    is_bf16 = weight.dtype == torch.bfloat16
    return library().aftgen_rowdot_kernel(is_bf16, weight.shape[0], weight.shape[1]).decode()


def _compiler() -> str:
    return torch._inductor.cpp_builder.get_cpp_compiler()


def _key() -> str:
    """What the library depends on: its sources, torch's headers (their version) and the compiler's flags."""
    facts = [torch.__version__, platform.machine(), _compiler(), *FLAGS]
    return hashlib.sha256(b"".join(map(own_source, SOURCES)) + repr(facts).encode()).hexdigest()[:20]


def _build(path: Path) -> None:
    """Compile the sources into `path`, in a folder of this process's own (aftgen.compiled.cache copies the
    library into the cache)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    command = [_compiler(), *FLAGS, *(f"-I{include}" for include in include_paths()), *map(str, SOURCES)]
    command += ["-o", str(path)]
    command += [f"-L{lib}" for lib in library_paths()] + ["-ltorch_cpu", "-lc10"]
    returncode, errors = _run(command)
    if returncode:
        last = (errors.strip().splitlines() or ["no message"])[-1]
        raise RowdotUnavailable(f"cannot build the batch-invariant product: {_compiler()} said: {shown(last)}")


def _run(command: list[str]) -> tuple[int, str]:
    """The compiler's exit status and its stderr; one that hangs is killed with all it started (cc1plus, as,
    ld), which would go on writing into the folder being deleted."""
    try:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)  # fmt: skip
    except OSError as exc:
        raise RowdotUnavailable(f"cannot build the batch-invariant product ({exc.strerror or exc})") from None
    try:
        _, errors = process.communicate(timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise RowdotUnavailable(f"cannot build the batch-invariant product: {_compiler()} took over "
                                f"{BUILD_TIMEOUT} s") from None  # fmt: skip
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, errors


@torch.library.custom_op("aftgen::rowdot", mutates_args=(), device_types="cpu")
def rowdot(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 @ weight (N, K)ᵀ in float32 or bf16 → (M, N) float32, each output summed in one
    order whatever M is."""
    _check_operands(x, weight)
    x, weight = x.contiguous(), weight.contiguous()
    y = x.new_empty(x.shape[0], weight.shape[0])
    library().aftgen_rowdot(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.dtype == torch.bfloat16,
                            weight.shape[0], y.data_ptr(), 0)  # fmt: skip
    return y


@rowdot.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check_operands(x, weight)
    return x.new_empty(x.shape[0], weight.shape[0])


def _check_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    """What the C kernel reads: a float32 matrix x and a float32 or bf16 one of the same width."""
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "rowdot multiplies matrices")
    torch._check(x.dtype == torch.float32, lambda: f"rowdot takes x in float32, not {x.dtype}")
    torch._check(weight.dtype in (torch.float32, torch.bfloat16), lambda: f"rowdot's weight: not {weight.dtype}")
    torch._check(x.shape[1] == weight.shape[1], lambda: f"rowdot: x is {x.shape[1]} wide, the weight {weight.shape[1]}")


@functools.cache
def scores_library() -> ctypes.CDLL | None:
    """The library for top_scores, or None where it cannot be built or loaded here (no compiler, a build that failed,
    a cache folder that cannot be used), said once in one line: asked once, as a step must not wait on a compiler
    that failed, and a request's scores must not fail where torch.topk can give them."""
    try:
        return library()
    except (AftgenError, OSError, RuntimeError) as exc:  # torch's InvalidCxxCompiler (no compiler) is a RuntimeError
        print(f"warning: {exc or type(exc).__name__}: log-probabilities are scored through torch", file=sys.stderr,
              flush=True)  # fmt: skip
        return None


def top_scores(logits: torch.Tensor, tokens: torch.Tensor, k: int, level: int | None = None) -> torch.Tensor | None:
    """Each row of `logits` (T, V) on a CPU, made log-probabilities (log_softmax): the log-probability of its token in
    `tokens` (T,) and the `k` largest, high to low (the lower id first among equal logits), packed as int32
    (T, 1 + 2k): [the token's figure, the k figures (float32 bits), their ids]. None where the library cannot serve
    it: it cannot be built here, or k is above the most it keeps. `level`: the kernel compiled for which level of
    the machine (0 to scores_levels() - 1; None: the highest, as the server runs), for tests."""
    on_cpu = logits.device.type == tokens.device.type == "cpu"
    shapes = logits.dim() == 2 and logits.shape[1] > 0 and tokens.shape == logits.shape[:1]
    if not (shapes and on_cpu and 0 <= k <= logits.shape[1]):
        raise ValueError(
            f"top_scores reads logits (T, V > 0) and tokens (T,) on a CPU and 0 <= k <= V, not {logits.shape} on "
            f"{logits.device}, {tokens.shape} on {tokens.device} and k={k}"
        )
    loaded = scores_library()
    if loaded is None or k > loaded.top_scores_most:
        return None
    levels = loaded.top_scores_levels
    level = levels - 1 if level is None else level
    if not 0 <= level < levels:
        raise ValueError(f"top_scores: this machine runs levels 0 to {levels - 1} of the kernel, not {level}")
    logits, tokens = logits.float().contiguous(), tokens.long().contiguous()
    packed = torch.empty(logits.shape[0], 1 + 2 * k, dtype=torch.int32)
    failed = loaded.aftgen_top_scores(level, logits.data_ptr(), logits.shape[0], logits.shape[1], tokens.data_ptr(),
                                      k, packed.data_ptr())  # fmt: skip
    if failed:
        raise ValueError(f"top_scores: a token is out of range for a vocabulary of {logits.shape[1]}")
    return packed


def scores_levels() -> int:
    """How many levels of top_scores's kernel this machine runs (base; x86-64-v3; v4), 0 without the library."""
    loaded = scores_library()
    return 0 if loaded is None else loaded.top_scores_levels


class ScoreJSON:
    """The shown form of many tokens' scores in one call to the library (score_json.cpp): what aftgen.serve.replies's
    ScoreWriter writes in Python, byte for byte; `names` and `entries` are its."""

    def __init__(self, loaded: ctypes.CDLL, names: list[str], entries: list[str]):
        first: dict[str, int] = {}
        firsts = (ctypes.c_int32 * len(names))(*[first.setdefault(name, token) for token, name in enumerate(names)])
        (text, at), (entry_text, entry_at) = _blob(names), _blob(entries)
        self._kept = (text, at, entry_text, entry_at, firsts)  # what self.names points into
        as_pointer = functools.partial(ctypes.cast, typ=ctypes.c_char_p)
        self.names = _Names(as_pointer(text), at, as_pointer(entry_text), entry_at, firsts, len(names))
        self.write = loaded.aftgen_score_json
        # the most a name (completions) or an entry's start (chat) takes, and what a token or an alternative adds to
        # it at most: a figure (15), separators and chat's `,"top_logprobs":[`
        self.longest = {False: max(at[i + 1] - at[i] for i in range(len(names))) + 24,
                        True: max(entry_at[i + 1] - entry_at[i] for i in range(len(names))) + 40}  # fmt: skip

    def __call__(self, tokens: list[tuple[int, int, bool, str]]) -> list[str]:
        """Each of `tokens` ((id, top, chat, score record) each) shown: completions' name, figure and map between
        UNIT separators, or chat's whole entry. A call a SCORE_PIECE tokens: an echo's thousands of prompt tokens do
        not hold the GIL, nor a buffer sized for all of them, at once."""
        return [
            shown for at in range(0, len(tokens), SCORE_PIECE) for shown in self._piece(tokens[at : at + SCORE_PIECE])
        ]

    def _piece(self, tokens: list[tuple[int, int, bool, str]]) -> list[str]:
        text = " ".join([f"{token} {top} {int(chat)} {record or '-'}" for token, top, chat, record in tokens]).encode()
        # a token and its alternatives (at most top, and at most what its record holds), each at most `longest`
        size = sum([(1 + min(top, max(0, len(record) // 8 - 1) // 2)) * self.longest[chat]
                    for _, top, chat, record in tokens])  # fmt: skip
        out = ctypes.create_string_buffer(size)
        written = self.write(ctypes.byref(self.names), text, len(text), len(tokens), out, size)
        if written < 0:
            raise ValueError(f"score_json: {'a score record it cannot read' if written == -1 else 'no room'}")
        return ctypes.string_at(out, written).decode().split(RECORD) if tokens else []


def _blob(texts: list[str]) -> tuple[ctypes.Array, ctypes.Array]:
    """Texts as one UTF-8 buffer and the offsets of each one's start (and of the end)."""
    encoded = [text.encode() for text in texts]
    offsets = [0]
    for piece in encoded:
        offsets.append(offsets[-1] + len(piece))
    return ctypes.create_string_buffer(b"".join(encoded)), (ctypes.c_int64 * len(offsets))(*offsets)


def score_json(names: list[str], entries: list[str]) -> ScoreJSON | None:
    """The library's writer of `logprobs` JSON for these names, or None where the library cannot be had here."""
    loaded = scores_library()
    return None if loaded is None else ScoreJSON(loaded, names, entries)
