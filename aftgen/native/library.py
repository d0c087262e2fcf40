"""aftgen's native library: matmul_rows.cpp, top_scores.cpp and scores_json.cpp built into one shared library in
aftgen's cache, and loaded with the C signatures of what it exports.

It is built with the C++ compiler that compiles the step (Inductor's) into aftgen's cache on first use, a
second or two, and loaded with its symbols global: a step package calls `aoti_torch_cpu_matmul_rows` through
AOTInductor's custom-op shims (aftgen.native.matmul_rows.SHIM), named for the op: `aftgen::matmul_rows` is
called as `aoti_torch_cpu_matmul_rows`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import signal
import subprocess
from pathlib import Path

import torch

from aftgen.compiled.availability import NATIVE, Verdict, decide
from aftgen.compiled.cache import cached_library, compiled_folder
from aftgen.errors import AftgenError
from aftgen.files import own_source, shown

SOURCES = tuple(Path(__file__).with_name(name) for name in ("matmul_rows.cpp", "top_scores.cpp", "scores_json.cpp"))
# No -march: the kernel is chosen as it runs. -fno-trapping-math lets top_scores' clamps become vector max/min (no
# figure changes: it only lets floating-point exceptions, which nothing here reads, go unraised).
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math"]
BUILD_TIMEOUT = 300  # seconds: a compiler that hangs is not waited for
# What runs where the library cannot be had (usable_library)
WITHOUT = "log-probabilities are scored through torch and shown in Python, and the step is not batch-invariant"


class NativeUnavailable(AftgenError):
    """The native library cannot be built here (no C++ compiler, or it failed): the message says why."""


@functools.cache
def library() -> ctypes.CDLL:
    """The native library, built into aftgen's cache if it is not there intact, and loaded with its symbols
    global (step packages resolve `aoti_torch_cpu_matmul_rows` from it)."""
    loaded = ctypes.CDLL(str(library_path()), mode=ctypes.RTLD_GLOBAL)
    loaded.aftgen_matmul_rows.restype = None
    loaded.aftgen_matmul_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                          ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    loaded.aftgen_matmul_rows_kernel.restype = ctypes.c_char_p
    loaded.aftgen_matmul_rows_kernel.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    loaded.aftgen_top_scores.restype = ctypes.c_int
    loaded.aftgen_top_scores.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                         ctypes.c_int, ctypes.c_void_p]  # fmt: skip
    # The HTTP side's calls, a microsecond or two each, keep the GIL (PyDLL's functions): CDLL's let it go for the
    # call, and on a busy server taking it back waited on the server's other threads longer than the call took.
    holding = ctypes.PyDLL(loaded._name, handle=loaded._handle)
    loaded.aftgen_score_json, loaded.aftgen_format_figure = holding.aftgen_score_json, holding.aftgen_format_figure
    loaded.aftgen_score_json.restype = ctypes.c_int64
    loaded.aftgen_score_json.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64,
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
    return cached_library(compiled_folder() / f"native-{_key()}.so", _build)[0]


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
        raise NativeUnavailable(f"cannot build the native library: {_compiler()} said: {shown(last)}")


def _run(command: list[str]) -> tuple[int, str]:
    """The compiler's exit status and its stderr; one that hangs is killed with all it started (cc1plus, as,
    ld), which would go on writing into the folder being deleted."""
    try:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)  # fmt: skip
    except OSError as exc:
        raise NativeUnavailable(f"cannot build the native library ({exc.strerror or exc})") from None
    try:
        _, errors = process.communicate(timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise NativeUnavailable(f"cannot build the native library: {_compiler()} took over "
                                f"{BUILD_TIMEOUT} s") from None  # fmt: skip
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, errors


@functools.cache
def decided() -> tuple[ctypes.CDLL | None, Verdict]:
    """The library, or None where it cannot be built or loaded here (no compiler, a build that failed, a cache folder
    that cannot be used), and the verdict: decided once (aftgen.compiled.availability: said in one line, kept for
    the reports), as a step must not wait on a compiler that failed, and a request's scores must not fail where
    torch.topk can give them."""
    # torch's InvalidCxxCompiler (no compiler) is a RuntimeError
    return decide(NATIVE, library, WITHOUT, failures=(AftgenError, OSError, RuntimeError))


def usable_library() -> ctypes.CDLL | None:
    """The library, or None where it cannot be had here (`decided`)."""
    return decided()[0]
