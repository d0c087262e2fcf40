"""aftgen.native.library: built into aftgen's cache once and checked before it is loaded (a damaged or planted
file is built again, never loaded), its cache's lock waited for or done without, and a compiler that fails or
hangs is one clear error."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from aftgen import files
from aftgen.compiled import cache as compiled_cache
from aftgen.compiled.cache import compiled_folder
from aftgen.errors import AftgenError
from aftgen.native import library


@pytest.fixture(scope="module")
def one_build(tmp_path_factory):
    """The library built once, in a cache of this module's own: its folder."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AFTGEN_CACHE", str(cache))
        library.library_path()
        return compiled_folder()


@pytest.fixture
def built(one_build, tmp_path, monkeypatch):
    """A cache of this test's own holding the library as built and recorded, and the names of the builds after
    that (each a copy of the one build, made in a private folder)."""
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path / "cache"))
    shutil.copytree(one_build, compiled_folder(), ignore=shutil.ignore_patterns("*.lock"))
    path, builds = next(compiled_folder().glob("native-*.so")), []
    monkeypatch.setattr(
        library, "_build", lambda target: builds.append(target.name) or shutil.copyfile(one_build / path.name, target)
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
    assert library.library_path() == path and builds == [path.name]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "aftgen's native library in the cache was damaged" in lines[0], lines
    assert library.library_path() == path and builds == [path.name]  # what was built again is recorded


def test_a_link_planted_where_the_library_lies_is_replaced_and_its_target_left_alone(built, tmp_path):
    path, builds = built
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's own file")
    path.unlink()
    path.symlink_to(victim)
    assert library.library_path() == path and builds == [path.name]
    assert victim.read_bytes() == b"the user's own file" and not path.is_symlink()


def test_a_link_to_an_intact_library_is_built_again_not_loaded_through(built, tmp_path, capsys):
    path, builds = built
    capsys.readouterr()
    shutil.copyfile(path, tmp_path / "copy.so")  # the very bytes recorded: only the link is wrong
    path.unlink()
    path.symlink_to(tmp_path / "copy.so")
    assert library.library_path() == path and builds == [path.name] and not path.is_symlink()
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
    assert library.library_path() == path and not builds
    assert capsys.readouterr().err == ""


def test_a_library_whose_lock_cannot_be_had_is_built_privately_with_one_line(built, unlockable, capsys, no_hang):
    path, builds = built
    path.unlink()
    capsys.readouterr()
    built_at = library.library_path()
    assert built_at != path and built_at.name == path.name and builds == [path.name]
    assert not os.path.lexists(path) and library.library_path() != path  # and again: said once
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
        built_at = library.library_path()
    assert built_at != path and builds == [path.name]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("waiting for another aftgen process to build aftgen's native library")
    assert f"{path.with_suffix('.lock')} was held by another process for over 0.5 s" in lines[1]


@pytest.mark.parametrize("compiler", ["false", "/no/such/compiler"])
def test_a_compiler_that_fails_is_one_clear_error(compiler, tmp_path, monkeypatch):
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(library, "_compiler", lambda: compiler)
    with pytest.raises(library.NativeUnavailable, match="^cannot build the native library") as error:
        library.library_path()
    assert "\n" not in str(error.value)
    assert not list(compiled_folder().glob("native-*.so")) and not list(compiled_folder().glob("tmp*"))


def test_a_compiler_that_hangs_is_stopped_with_all_it_started(tmp_path, monkeypatch):
    child = tmp_path / "child"
    compiler = tmp_path / "compiler"
    compiler.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {child}\nwait\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(library, "_compiler", lambda: str(compiler))
    monkeypatch.setattr(library, "BUILD_TIMEOUT", 1)
    with pytest.raises(library.NativeUnavailable, match="took over 1 s"):
        library.library_path()
    pid = int(child.read_text())
    for _ in range(100):  # killed at once; reaped by init a moment later
        if not os.path.exists(f"/proc/{pid}") or " Z " in open(f"/proc/{pid}/stat").read():
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the compiler's child outlived it")
