"""aftgen.rowdot, the batch-invariant product: a row's outputs are the same bits alone as among any other rows,
and close to x @ wᵀ; its library is built into aftgen's cache once and checked before it is loaded (a damaged
or planted file is built again, never loaded), and a compiler that fails is one clear error."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from aftgen import files, layers, rowdot
from aftgen.compiled import cache as compiled_cache
from aftgen.compiled.cache import compiled_folder
from aftgen.errors import AftgenError

WEIGHTS = {"float32": torch.float32, "bf16": torch.bfloat16}
SHAPES = [(576, 192), (192, 768), (33, 64), (17, 40), (1, 15)]  # (outputs, inputs): tiles, and tails of each


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_a_rows_product_alone_is_the_same_bits_as_among_other_rows(weights, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=generator).to(WEIGHTS[weights])
    x = torch.randn(33, shape[1], generator=generator)
    together = rowdot.rowdot(x, w)
    for rows in (1, 2, 5, 16, 17, 32):
        for start in (0, 1, 33 - rows):
            assert torch.equal(rowdot.rowdot(x[start : start + rows], w), together[start : start + rows]), (rows, start)
    inputs = x.bfloat16() if rowdot.kernel(w) == "amx" else x  # AMX multiplies bf16 by bf16
    expected = inputs.double() @ w.double().T
    torch.testing.assert_close(together.double(), expected, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


@pytest.fixture(scope="module")
def one_build(tmp_path_factory):
    """The library built once, in a cache of this module's own: its folder."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AFTGEN_CACHE", str(cache))
        rowdot.library_path()
        return compiled_folder()


@pytest.fixture
def built(one_build, tmp_path, monkeypatch):
    """A cache of this test's own holding the library as built and recorded, and the names of the builds after
    that (each a copy of the one build, made in a private folder)."""
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path / "cache"))
    shutil.copytree(one_build, compiled_folder(), ignore=shutil.ignore_patterns("*.lock"))
    path, builds = next(compiled_folder().glob("rowdot-*.so")), []
    monkeypatch.setattr(
        rowdot, "_build", lambda target: builds.append(target.name) or shutil.copyfile(one_build / path.name, target)
    )
    return path, builds


DAMAGES = {
    "cut short": lambda path: path.write_bytes(path.read_bytes()[:50_000]),
    "garbage": lambda path: path.write_bytes(os.urandom(path.stat().st_size)),
    "empty": lambda path: path.write_bytes(b""),
    "a FIFO": lambda path: path.unlink() or os.mkfifo(path),
    "no record": lambda path: path.with_suffix(".json").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_library_is_built_again_with_one_line_not_loaded(built, damage, capsys):
    path, builds = built
    capsys.readouterr()
    DAMAGES[damage](path)
    assert rowdot.library_path() == path and builds == [path.name]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "the batch-invariant product's library in the cache was damaged" in lines[0], lines
    assert rowdot.library_path() == path and builds == [path.name]  # what was built again is recorded


def test_a_link_planted_where_the_library_lies_is_replaced_and_its_target_left_alone(built, tmp_path):
    path, builds = built
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's own file")
    path.unlink()
    path.symlink_to(victim)
    assert rowdot.library_path() == path and builds == [path.name]
    assert victim.read_bytes() == b"the user's own file" and not path.is_symlink()


def test_a_link_to_an_intact_library_is_built_again_not_loaded_through(built, tmp_path, capsys):
    path, builds = built
    capsys.readouterr()
    shutil.copyfile(path, tmp_path / "copy.so")  # the very bytes recorded: only the link is wrong
    path.unlink()
    path.symlink_to(tmp_path / "copy.so")
    assert rowdot.library_path() == path and builds == [path.name] and not path.is_symlink()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "library in the cache was damaged" in lines[0] and "is a link" in lines[0], lines


def read_only(lock: Path) -> None:
    """What a read-only cache does to its lock (as root, chmod would not stop the open)."""
    raise AftgenError(f"cannot lock {lock.parent} (Read-only file system)")


LOCKS = {
    "a FIFO": os.mkfifo,
    "a link": lambda lock: lock.symlink_to(lock.with_name("elsewhere")),
    "a read-only disk": lambda lock: None,
}


@pytest.fixture(params=LOCKS)
def unlockable(request, built, monkeypatch):
    """The library's cache where its lock cannot be had, and why not."""
    path, _ = built
    lock = path.with_suffix(".lock")
    lock.unlink(missing_ok=True)
    LOCKS[request.param](lock)
    if request.param == "a read-only disk":
        monkeypatch.setattr(files, "open_lock", read_only)
    return {"a FIFO": "is a FIFO", "a link": "is a link", "a read-only disk": "(Read-only file system)"}[request.param]


def test_an_intact_library_is_read_without_its_lock(built, unlockable, capsys, no_hang):
    path, builds = built
    capsys.readouterr()
    assert rowdot.library_path() == path and not builds
    assert capsys.readouterr().err == ""


def test_a_library_whose_lock_cannot_be_had_is_built_privately_with_one_line(built, unlockable, capsys, no_hang):
    path, builds = built
    path.unlink()
    capsys.readouterr()
    library = rowdot.library_path()
    assert library != path and library.name == path.name and builds == [path.name]
    assert not os.path.lexists(path) and rowdot.library_path() != path  # and again: said once
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and unlockable in lines[0], lines
    assert lines[0].endswith(": compiled code is kept in a private temporary folder"), lines


def test_a_held_lock_is_waited_for_a_while_saying_so_then_the_library_built_privately(built, monkeypatch, capsys,
                                                                                      no_hang):  # fmt: skip
    path, builds = built
    path.unlink()
    capsys.readouterr()
    monkeypatch.setattr(compiled_cache, "LOCK_WAIT", 0.5)
    monkeypatch.setattr(files, "LOCK_NOTICE", 0.1)
    with files.locked_file(path.with_suffix(".lock")):  # held through another open file: as another process would
        library = rowdot.library_path()
    assert library != path and builds == [path.name]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("waiting for another aftgen process to build the batch-invariant product's library")
    assert f"{path.with_suffix('.lock')} was held by another process for over 0.5 s" in lines[1]


@pytest.mark.parametrize("compiler", ["false", "/no/such/compiler"])
def test_a_compiler_that_fails_is_one_clear_error(compiler, tmp_path, monkeypatch):
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(rowdot, "_compiler", lambda: compiler)
    with pytest.raises(rowdot.RowdotUnavailable, match="^cannot build the batch-invariant product") as error:
        rowdot.library_path()
    assert "\n" not in str(error.value)
    assert not list(compiled_folder().glob("rowdot-*.so")) and not list(compiled_folder().glob("tmp*"))


def test_a_compiler_that_hangs_is_stopped_with_all_it_started(tmp_path, monkeypatch):
    child = tmp_path / "child"
    compiler = tmp_path / "compiler"
    compiler.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {child}\nwait\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(rowdot, "_compiler", lambda: str(compiler))
    monkeypatch.setattr(rowdot, "BUILD_TIMEOUT", 1)
    with pytest.raises(rowdot.RowdotUnavailable, match="took over 1 s"):
        rowdot.library_path()
    pid = int(child.read_text())
    for _ in range(100):  # killed at once; reaped by init a moment later
        if not os.path.exists(f"/proc/{pid}") or " Z " in open(f"/proc/{pid}/stat").read():
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the compiler's child outlived it")


BAD_OPERANDS = {
    "a float16 weight": (torch.randn(2, 8), torch.randn(4, 8).half(), "weight"),
    "a float64 x": (torch.randn(2, 8).double(), torch.randn(4, 8), "float32"),
    "other widths": (torch.randn(2, 8), torch.randn(4, 9), "8 wide"),
    "a vector": (torch.randn(8), torch.randn(4, 8), "matrices"),
}


@pytest.mark.parametrize("case", BAD_OPERANDS)
def test_operands_the_kernel_cannot_read_are_refused_not_read(case):
    x, weight, named = BAD_OPERANDS[case]
    with pytest.raises(RuntimeError, match=named):
        rowdot.rowdot(x, weight)


def refused():
    raise rowdot.RowdotUnavailable("cannot build the batch-invariant product: g++ said: no")


def test_batch_invariance_by_default_where_rowdot_serves_a_compiled_cpu_step(monkeypatch, capsys):
    """Whatever the CPU's units and the weights' dtype (not asked): on by default for a compiled CPU step, to be
    timed; off on a GPU, for the eager step, and where rowdot cannot be built; as asked where asked."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(layers, "library", lambda: None)
    assert layers.batch_invariant(None, cpu, True) == layers.Invariance(True, by_default=True)
    assert not layers.batch_invariant(None, cpu, False).on and not layers.batch_invariant(None, gpu, True).on
    assert layers.batch_invariant(True, gpu, False) == layers.Invariance(True)
    assert layers.batch_invariant(False, cpu, True) == layers.Invariance(False, "--no-batch-invariant")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(layers, "library", refused)
    assert not layers.batch_invariant(None, cpu, True).on
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["warning: cannot build the batch-invariant product: g++ said: no: the step is not batch-invariant"]
    assert layers.batch_invariant(True, cpu, True).on  # asked for: it is, or compiling it says why not


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
