"""The compiled step in aftgen's cache (aftgen.compiled.cache): a damaged entry is compiled again with one line,
never loaded; where the cache cannot take an entry (a damaged one that cannot be deleted, a file where its folder
should be, a full disk, a linked folder) the step is compiled privately with one line saying why."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from compiled_steps import MAX_BATCH, assert_gives_the_eager_logits, compile_tiny

import aftgen.compiled.step
from aftgen.compiled.cache import library_of
from aftgen.compiled.step import compile_step, step_package
from aftgen.model import AFTLM


@pytest.fixture(scope="module")
def compiled():
    return compile_tiny()


def cache_copy(model: AFTLM, cache: Path) -> Path:
    """The session cache's compiled step for `model` (package, library, record) copied into the cache folder
    `cache`; the copy's package."""
    package, _ = step_package(model, MAX_BATCH)
    (cache / "compiled").mkdir(parents=True)
    for original in package.parent.glob(f"{package.stem}.*"):
        shutil.copyfile(original, cache / "compiled" / original.name)
    return cache / "compiled" / package.name


@pytest.fixture
def stand_in_compiler(compiled, monkeypatch) -> list[str]:
    """The names of the packages that a stand-in for the compiler writes: the package compiled before (a real
    compile takes tens of seconds), written as files.atomic_write writes (on a full disk, torch's package
    writer fails too: it aborts the process)."""
    package, _ = step_package(compiled[0], MAX_BATCH)
    compiled_package, builds = package.read_bytes(), []

    def compile_again(model: AFTLM, max_batch: int, written: bool, path: Path) -> None:
        builds.append(path.name)
        aftgen.files.atomic_write(path, compiled_package, durable=False)

    monkeypatch.setattr(aftgen.compiled.step, "_package_step", compile_again)
    return builds


@pytest.fixture
def own_cache(stand_in_compiler, compiled, tmp_path, monkeypatch) -> tuple[Path, list[str]]:
    """A cache folder of this test's holding a copy of the compiled step (its package), and the names of the
    packages the stand-in compiler writes."""
    package = cache_copy(compiled[0], tmp_path)
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path))
    return package, stand_in_compiler


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * (path.stat().st_size // 256))


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


DAMAGES = {  # a library cut short is the subprocess test's: it kills the process that loads it
    "an empty library": lambda package: library_of(package).write_bytes(b""),
    "a garbage library": lambda package: _garbage(library_of(package)),
    "a FIFO for the library": lambda package: _fifo(library_of(package)),
    "a package cut short": lambda package: package.write_bytes(package.read_bytes()[:50_000]),
    "a garbage package": _garbage,
    "no record": lambda package: package.with_suffix(".json").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_step_in_the_cache_is_compiled_again_with_one_line(compiled, own_cache, damage, capsys, no_hang):
    model, _ = compiled
    package, builds = own_cache
    DAMAGES[damage](package)
    step, note = compile_step(model, MAX_BATCH)
    assert note.startswith("compiled in"), note  # not eager, and not "from the cache"
    assert builds == [package.name]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "the compiled step in the cache was damaged" in lines[0], lines
    assert_gives_the_eager_logits(model, step)
    assert compile_step(model, MAX_BATCH)[1].startswith("compiled (from the cache)")  # what was rebuilt is recorded


def test_a_library_cut_short_is_compiled_again_not_loaded(compiled, tmp_path):
    """The audit's case: a library cut short was mapped past its end, and its loader died of SIGBUS (exit -7)."""
    package = cache_copy(compiled[0], tmp_path)
    compiled_package = tmp_path / "compiled.pt2"
    shutil.copyfile(package, compiled_package)
    library_of(package).write_bytes(library_of(package).read_bytes()[:50_000])
    child = f"""
import shutil, aftgen.compiled.step
from compiled_steps import MAX_BATCH, assert_gives_the_eager_logits, tiny_model
aftgen.compiled.step._package_step = lambda model, rows, written, path: shutil.copyfile({str(compiled_package)!r}, path)
model = tiny_model()
step, note = aftgen.compiled.step.compile_step(model, MAX_BATCH)
assert_gives_the_eager_logits(model, step)
print(note)
"""
    tests = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])  # conftest's
    env = os.environ | {"AFTGEN_CACHE": str(tmp_path), "PYTHONPATH": tests}
    result = subprocess.run(
        [sys.executable, "-c", child], cwd=Path(__file__).parent, capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("compiled in"), result.stdout
    assert len(result.stderr.splitlines()) == 1 and "(50,000 bytes) is not the file recorded" in result.stderr


def assert_compiled_privately(model: AFTLM, step, note: str, builds: list[str], lines: list[str], why: str) -> None:
    """The step compiled again (once) outside the cache, and one line saying `why`."""
    assert note.startswith("compiled in"), note  # not eager, and not "from the cache"
    assert len(builds) == 1 and len(lines) == 1, lines
    assert lines[0].startswith("warning: ") and why in lines[0], lines
    assert lines[0].endswith("compiled code is kept in a private temporary folder"), lines
    assert_gives_the_eager_logits(model, step)


def test_a_damaged_step_that_cannot_be_deleted_is_compiled_privately_naming_it(compiled, own_cache, capsys):
    model, _ = compiled
    package, builds = own_cache
    library_of(package).unlink()
    (library_of(package) / "in the way").mkdir(parents=True)  # a folder: never deleted whole
    step, note = compile_step(model, MAX_BATCH)
    lines = capsys.readouterr().err.splitlines()[1:]  # after the line that says it was damaged
    why = f"{library_of(package)} cannot be deleted (Is a directory): delete it to compile the step again"
    assert_compiled_privately(model, step, note, builds, lines, why)


def test_a_file_where_the_compiled_folder_should_be_compiles_the_step_privately(
    compiled, stand_in_compiler, tmp_path, monkeypatch, capsys
):
    (tmp_path / "compiled").write_text("not a folder")
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path))
    step, note = compile_step(compiled[0], MAX_BATCH)
    why = f"{tmp_path / 'compiled'} is not a folder: delete it to keep the compiled step in the cache"
    assert_compiled_privately(compiled[0], step, note, stand_in_compiler, capsys.readouterr().err.splitlines(), why)
    assert (tmp_path / "compiled").read_text() == "not a folder"


def test_a_full_cache_disk_compiles_the_step_privately_leaving_nothing_there(compiled, own_cache, monkeypatch, capsys):
    model, _ = compiled
    package, builds = own_cache
    for entry in package.parent.glob(f"{package.stem}.*"):
        entry.unlink()  # not in the cache: compiled now, onto a disk that is full
    write = aftgen.files.atomic_write

    def write_on_a_full_disk(path: Path, data: bytes | str, durable: bool = True) -> None:
        if Path(path).parent != package.parent:
            return write(path, data, durable)
        with aftgen.files.atomic_open(path, "wb", durable):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(aftgen.files, "atomic_write", write_on_a_full_disk)
    step, note = compile_step(model, MAX_BATCH)
    lines = capsys.readouterr().err.splitlines()
    assert_compiled_privately(model, step, note, builds, lines, f"disk full while writing {package}")
    assert [entry.name for entry in package.parent.iterdir()] == [package.with_suffix(".lock").name]


def test_a_linked_compiled_folder_is_not_read_through_the_link(compiled, own_cache, tmp_path, capsys):
    model, _ = compiled
    package, builds = own_cache
    package.parent.rename(tmp_path / "elsewhere")  # an intact entry, reached through the link
    package.parent.symlink_to(tmp_path / "elsewhere")
    step, note = compile_step(model, MAX_BATCH)
    why = f"{package.parent} is a link, which aftgen never makes"
    assert_compiled_privately(model, step, note, builds, capsys.readouterr().err.splitlines(), why)
