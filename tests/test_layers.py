"""aftgen.layers: whether the step is batch-invariant by default (on for a compiled CPU step where the native
library serves it, to be confirmed by timing; off on a GPU, for the eager step and where it cannot be built) and
what a timing that finds it slower decides."""

from __future__ import annotations

import torch

from aftgen import layers
from aftgen.native import library


def refused():
    raise library.NativeUnavailable("cannot build the native library: g++ said: no")


def test_batch_invariance_by_default_where_the_native_library_serves_a_compiled_cpu_step(monkeypatch, capsys):
    """Whatever the CPU's units and the weights' dtype (not asked): on by default for a compiled CPU step, to be
    timed; off on a GPU, for the eager step, and where the native library cannot be built (said once, in its
    line); as asked where asked."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(library, "library", lambda: None)
    library.decided.cache_clear()
    assert layers.batch_invariant(None, cpu, True) == layers.Invariance(True, by_default=True)
    assert not layers.batch_invariant(None, cpu, False).on and not layers.batch_invariant(None, gpu, True).on
    assert layers.batch_invariant(True, gpu, False) == layers.Invariance(True)
    assert layers.batch_invariant(False, cpu, True) == layers.Invariance(False, "--no-batch-invariant")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(library, "library", refused)
    library.decided.cache_clear()
    try:
        why = "NativeUnavailable: cannot build the native library: g++ said: no"
        assert layers.batch_invariant(None, cpu, True) == layers.Invariance(False, why)
        lines = capsys.readouterr().err.splitlines()
        assert lines == [f"warning: aftgen's native library cannot be used here ({why}): {library.WITHOUT}"]
        assert layers.batch_invariant(True, cpu, True).on  # asked for: it is, or compiling it says why not
    finally:
        library.decided.cache_clear()


def test_the_default_stays_on_unless_timed_over_a_tenth_slower(capsys):
    """The timings are given (rows -> the invariant step's seconds, the matrix kernels' step's): no clock here."""
    on = layers.Invariance(True, by_default=True)
    assert layers.judged({1: (1.0, 1.0), 32: (2.2, 2.0)}) == on  # a tenth slower at most: on
    assert layers.judged({1: (0.5, 1.0), 32: (0.9, 2.0)}) == on
    assert capsys.readouterr().err == ""
    slower = layers.judged({1: (1.0, 1.0), 32: (2.25, 2.0)})
    assert not slower.on and slower.reason == (
        "it took 1.12x the matrix kernels' step here at 32 rows (2250.00 against 2000.00 ms)"
    )
    assert capsys.readouterr().err.splitlines() == [
        f"warning: the step is not batch-invariant: {slower.reason}; --batch-invariant makes a seeded request's "
        "text the same alone and among others at that cost"
    ]
    assert not layers.judged({1: (1.2, 1.0), 32: (1.0, 2.0)}).on  # at either number of rows
