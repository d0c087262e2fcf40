"""A compiled step package's model, called through its C interface so that it runs without Python's lock.

torch's loader for an AOTInductor package (`aoti_load_package(...).loader.boxed_run`) holds the GIL for the
whole call. In `aftgen serve` that is most of every turn: the HTTP thread, which frames and sends the tokens
of the turn before, waits for each step, and the second core idles. The package's shared library has a C
interface (torch/csrc/inductor/aoti_runtime/interface.h) that ctypes calls with the GIL released.

The package holds no weights: the model's own tensors are handed to it once, as constants it reads in place
(user-managed), so a call takes only the token ids and the state. Each input costs a call a C++ handle and
a pointer read through ctypes (about half a microsecond): the weights as inputs cost a small model's step
an eighth of its time.

One more thing takes the lock inside a call: a tensor that Python also holds takes the GIL when a C++
reference to it is dropped and only Python's remains. The call drops the references it is handed (the ids,
the state), so the runner keeps one more to each input until the next call.
"""

from __future__ import annotations

import ctypes
import operator
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from aftgen.compiled.cache import library_of

_new_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors  # a new at::Tensor* for each, in capsules
_tensors_of_handles = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs
_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_pointer.restype, _pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule = ctypes.pythonapi.PyCapsule_New
_capsule.restype, _capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


PackageRunner = Callable[[list[torch.Tensor]], list[torch.Tensor]]  # a step package's inputs in, its outputs out


class PackageLibraryError(RuntimeError):
    """The package's library could not be loaded or run through its C interface."""


class _ConstantEntry(ctypes.Structure):  # AOTInductorConstantMapEntry
    _fields_ = [("name", ctypes.c_char_p), ("handle", ctypes.c_void_p)]


class UnlockedRunner:
    """`runner(inputs) -> outputs` for the CPU package at `package_path`, as its `loader.boxed_run` computes
    them, with Python's lock released while the model runs. `constants`: the tensors the package reads in
    place of weights, by their names in the exported module; they must outlive the runner. Cheapest where
    most inputs are the same tensors from call to call (a batch's state)."""

    def __init__(self, package_path: Path, constants: Mapping[str, torch.Tensor]):
        self.held: list[torch.Tensor | None] = []  # the last call's inputs, each with a C++ reference kept
        self._held_handles: list = []  # changed in place: the finalizer frees what it holds at the end
        self._constant_handles: list = []
        self.container = ctypes.c_void_p()
        self.library = ctypes.CDLL(str(library_of(package_path)))  # checked by aftgen.compiled.cache
        weakref.finalize(self, _close, self.library, self.container, self._held_handles, self._constant_handles)
        _check(self.library.AOTInductorModelContainerCreateWithDevice(ctypes.byref(self.container), 1, b"cpu", None))
        self._set_constants(constants)
        self.outputs = self._count("AOTInductorModelContainerGetNumOutputs")
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

    def _set_constants(self, constants: Mapping[str, torch.Tensor]) -> None:
        """Point the package's constants at `constants`' tensors, which it reads without copying."""
        count = self._count("AOTInductorModelContainerGetNumConstants")
        entries = (_ConstantEntry * count)()
        for index in range(count):
            name, original = ctypes.c_char_p(), ctypes.c_char_p()
            _check(self.library.AOTInductorModelContainerGetConstantName(self.container, index, ctypes.byref(name)))
            get_original = self.library.AOTInductorModelContainerGetConstantOriginalFQN
            _check(get_original(self.container, index, ctypes.byref(original)))
            self._constant_handles.extend(_new_handles([constants[original.value.decode()]]))
            entries[index].name, entries[index].handle = name.value, _pointer(self._constant_handles[-1], None)
        update = self.library.AOTInductorModelContainerUpdateUserManagedConstantBufferPairs
        _check(update(self.container, entries, count, False, True))

    def _count(self, function: str) -> int:
        count = ctypes.c_size_t()
        _check(getattr(self.library, function)(self.container, ctypes.byref(count)))
        return count.value

    def _hold(self, inputs: list[torch.Tensor]) -> None:
        """Keep a C++ reference to each input, in place of the one kept for the input at its position before."""
        if len(inputs) != len(self.held):
            _free(self._held_handles)
            self.held, self._held_handles[:] = [None] * len(inputs), [None] * len(inputs)
        for position in [i for i, same in enumerate(map(operator.is_, inputs, self.held)) if not same]:
            if self._held_handles[position] is not None:
                _tensors_of_handles([self._held_handles[position]])  # back into a tensor, dropped at once
            self.held[position], self._held_handles[position] = inputs[position], _new_handles([inputs[position]])[0]


def _free(handles: list) -> None:
    """Drop the C++ references that `handles` (capsules, or None) hold, and forget them."""
    _tensors_of_handles([handle for handle in handles if handle is not None])  # back into tensors, dropped
    handles[:] = [None] * len(handles)


def _close(library: ctypes.CDLL, container: ctypes.c_void_p, *handle_lists: list) -> None:
    """A runner's end (its finalizer, which also runs at exit while torch is still there)."""
    if container.value:  # None where creating it failed
        library.AOTInductorModelContainerDelete(container)
    for handles in handle_lists:
        _free(handles)


def _check(status: int) -> None:
    if status != 0:
        raise PackageLibraryError(f"the compiled step's library returned error {status}")
