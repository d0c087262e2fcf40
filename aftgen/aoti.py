"""A compiled step package's model, called through its C interface so that it runs without Python's lock.

torch's loader for an AOTInductor package (`aoti_load_package(...).loader.boxed_run`) holds the GIL for the
whole call. In `aftgen serve` that is most of every turn: the HTTP thread, which frames and sends the tokens
of the turn before, waits for each step, and the second core idles. The package's shared library has a C
interface (torch/csrc/inductor/aoti_runtime/interface.h) that ctypes calls with the GIL released.

One more thing takes the lock inside a call: a tensor that Python also holds takes the GIL when a C++
reference to it is dropped and only Python's remains. The call drops the references it is handed (about a
hundred: the weights, the ids, the state), so the runner keeps one more to each input until the next call.
"""

from __future__ import annotations

import ctypes
import operator
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from aftgen.files import atomic_open

_new_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors  # a new at::Tensor* for each, in capsules
_tensors_of_handles = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs
_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_pointer.restype, _pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule = ctypes.pythonapi.PyCapsule_New
_capsule.restype, _capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


PackageRunner = Callable[[list[torch.Tensor]], list[torch.Tensor]]  # a step package's inputs in, its outputs out


class PackageLibraryError(RuntimeError):
    """The package's library could not be loaded or run through its C interface."""


class UnlockedRunner:
    """`runner(inputs) -> outputs` for the CPU package at `package_path`, as its `loader.boxed_run` computes
    them, with Python's lock released while the model runs. Cheapest where most inputs are the same tensors
    from call to call (the weights, a batch's state)."""

    def __init__(self, package_path: Path):
        self.held: list[torch.Tensor | None] = []  # the last call's inputs, each with a C++ reference kept
        self._held_handles: list = []
        self.container = ctypes.c_void_p()
        self.library = ctypes.CDLL(str(_library_of(package_path)))
        _check(self.library.AOTInductorModelContainerCreateWithDevice(ctypes.byref(self.container), 1, b"cpu", None))
        outputs = ctypes.c_size_t()
        _check(self.library.AOTInductorModelContainerGetNumOutputs(self.container, ctypes.byref(outputs)))
        self.outputs = outputs.value
        self._run = self.library.AOTInductorModelContainerRun
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        self._hold(inputs)
        handles = _new_handles(inputs)  # taken over (and freed) by the call
        pointers = (ctypes.c_void_p * len(handles))(*map(_pointer, handles, [None] * len(handles)))
        results = (ctypes.c_void_p * self.outputs)()
        _check(self._run(self.container, pointers, len(handles), results, self.outputs, None, None))
        return _tensors_of_handles([_capsule(result, None, None) for result in results])

    def _hold(self, inputs: list[torch.Tensor]) -> None:
        """Keep a C++ reference to each input, in place of the one kept for the input at its position before."""
        if len(inputs) != len(self.held):
            self._release()
            self.held, self._held_handles = [None] * len(inputs), [None] * len(inputs)
        for position in [i for i, same in enumerate(map(operator.is_, inputs, self.held)) if not same]:
            if self._held_handles[position] is not None:
                _tensors_of_handles([self._held_handles[position]])  # back into a tensor, dropped at once
            self.held[position], self._held_handles[position] = inputs[position], _new_handles([inputs[position]])[0]

    def _release(self) -> None:
        _tensors_of_handles([handle for handle in self._held_handles if handle is not None])
        self.held, self._held_handles = [], []

    def __del__(self) -> None:
        self._release()
        if self.container.value:  # None where the library did not load
            self.library.AOTInductorModelContainerDelete(self.container)


def _check(status: int) -> None:
    if status != 0:
        raise PackageLibraryError(f"the compiled step's library returned error {status}")


def _library_of(package_path: Path) -> Path:
    """The package's shared library, extracted beside it once (written atomically: another process may be
    loading it)."""
    library = package_path.with_suffix(".so")
    if not library.exists():
        with zipfile.ZipFile(package_path) as package:
            members = [name for name in package.namelist() if name.endswith(".so")]
            if len(members) != 1:
                raise PackageLibraryError(f"{package_path} holds {len(members)} libraries, not one")
            with package.open(members[0]) as source, atomic_open(library) as target:
                target.write(source.read())
    return library
