"""The files door (aftgen.files): every file aftgen reads is a regular file of a bounded size, read without
blocking on a FIFO or device, and every write or lock leaves the file a planted link points to alone."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import httpx
import huggingface_hub.constants
import numpy as np
import pytest
from fake_hub import FakeHub
from serving import AUTH, running

import aftgen
from aftgen.api import load
from aftgen.bench.measure import tree_memory_mb
from aftgen.checkpoint import CHECKPOINT_FILES
from aftgen.compiled.cache import cached_package
from aftgen.corpus.cache import TokenFiles
from aftgen.errors import AftgenError
from aftgen.files import (
    LOCK,
    append_durably,
    atomic_write,
    locked_folder,
    open_regular,
    read_bytes,
    read_json,
    read_text,
    shown,
    truncate,
)
from aftgen.publish import push
from aftgen.serve.sessions import SUFFIX
from aftgen.state import load_state


def test_a_fifo_is_refused_at_once(tmp_path, no_hang):
    fifo = tmp_path / "entry.json"
    os.mkfifo(fifo)
    with pytest.raises(AftgenError, match=r"entry\.json: the entry is a FIFO, not a regular file"):
        read_bytes(fifo, 1000, "the entry")


def test_a_link_to_a_device_is_refused(tmp_path):
    link = tmp_path / "state.safetensors"
    link.symlink_to("/dev/zero")
    with pytest.raises(AftgenError, match="is a device, not a regular file"):
        read_bytes(link, 1000, "the state file")
    with pytest.raises(AftgenError, match="is a device"):
        open_regular(link, 1000, "the state file")


def test_a_file_over_its_limit_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big"
    with open(big, "wb") as handle:
        handle.truncate(3 << 30)  # sparse: 3 GB that take no disk and would take 3 GB of memory
    with pytest.raises(
        AftgenError, match=r"big: the state file is 3,221,225,472 bytes, more than it can hold \(1,000\)"
    ):
        read_bytes(big, 1000, "the state file")  # the size comes from fstat: nothing was read


def test_a_file_within_its_limit_is_read_whole(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 1000)
    assert read_bytes(tmp_path / "a", 1000, "a") == b"x" * 1000
    with pytest.raises(AftgenError, match="more than it can hold"):
        read_bytes(tmp_path / "a", 999, "a")


def test_a_deep_or_malformed_json_is_one_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AftgenError, match="nested too deep"):
        read_json(deep, 1 << 20, "the entry")
    (tmp_path / "bad.json").write_text('{"pid": ')
    with pytest.raises(AftgenError, match="bad.json: not valid JSON"):
        read_json(tmp_path / "bad.json", 1 << 20, "the entry")
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    with pytest.raises(AftgenError, match="is not utf-8 text"):
        read_text(tmp_path / "latin.txt", 100, "the text")


def test_shown_strips_control_characters_and_cuts():
    assert shown("aftgen \x1b[31msample\x1b]0;owned\x07\r\n\u202e") == "aftgen [31msample]0;owned"
    cut = shown("x" * 50_000_000)
    assert len(cut) == 200 and cut.endswith("…")


def test_an_atomic_write_replaces_a_link_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out").symlink_to(victim)
    atomic_write(tmp_path / "out", "new", durable=False)
    assert victim.read_text() == "precious"
    assert not (tmp_path / "out").is_symlink() and (tmp_path / "out").read_text() == "new"


@pytest.fixture
def victim(tmp_path):
    """A file of the user's that a planted link or hard link points to: it must come out unchanged."""
    path = tmp_path / "victim"
    path.write_text("precious")
    yield path
    assert path.read_text() == "precious"


@pytest.mark.parametrize("plant", ["symlink", "hard link", "foreign file"])
def test_a_lock_that_aftgen_did_not_make_is_refused_and_left_alone(tmp_path, victim, plant):
    folder = tmp_path / "run"
    folder.mkdir()
    lock = folder / LOCK
    {"symlink": lock.symlink_to, "hard link": lock.hardlink_to, "foreign file": lambda v: lock.write_text("mine")}[
        plant
    ](victim)
    with pytest.raises(AftgenError, match=r"\.lock (is a|holds).*remove it and retry"):
        with locked_folder(folder, print):
            pytest.fail("locked through a file that is not a lock")


def test_the_corpus_cache_lock_is_not_written_through_a_link(tmp_path, victim):
    (tmp_path / "entry").mkdir()
    (tmp_path / "entry" / ".lock").symlink_to(victim)
    files = TokenFiles(tmp_path / "entry", np.uint16, {"held_out": [], "train": []}, 400)
    with pytest.raises(AftgenError, match="is a link"), files.locked():
        pytest.fail("locked through a link")


def test_resuming_a_corpus_cache_entry_does_not_cut_the_file_a_token_file_links_to(tmp_path, victim):
    entry = tmp_path / "entry"
    entry.mkdir()
    zero = {"span": 0, "char": 0, "tokens": 0, "bytes": 0}  # a record that fits any corpus: nothing read yet
    (entry / "progress.json").write_text(json.dumps({"held_out": zero, "train": zero}))
    (entry / "held_out.bin").write_bytes(b"")
    (entry / "train.bin").symlink_to(victim)
    files = TokenFiles(entry, np.uint16, {"held_out": [], "train": []}, 400)
    files.resume(print)  # cut the token files back to the record: never the file a link points to
    assert not (entry / "train.bin").is_symlink() and (entry / "train.bin").read_bytes() == b""


@pytest.mark.parametrize("plant", ["symlink", "hard link"])
def test_a_file_changed_in_place_is_never_reached_through_a_link(tmp_path, victim, plant):
    token_file = tmp_path / "train.bin"  # swapped in after the entry was checked, say
    if plant == "symlink":
        token_file.symlink_to(victim)
    else:
        token_file.hardlink_to(victim)
    refused = "train.bin is a link" if plant == "symlink" else "train.bin is a file with another name"
    with pytest.raises(AftgenError, match=refused):
        truncate(token_file, 0)
    with pytest.raises(AftgenError, match=refused):
        append_durably(token_file, b"ids")


def _package(path: Path) -> None:
    """A stand-in for a compiled step's package: a zip holding one library."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("data/step.so", b"library")


def test_a_step_package_built_but_not_yet_recorded_is_not_taken_for_a_damaged_one(tmp_path, capsys):
    package, second = tmp_path / "step-key.pt2", {}

    def build(path: Path) -> None:
        _package(path)  # written, not yet recorded: another process starts now
        second["start"] = threading.Thread(target=lambda: second.update(found=cached_package(package, _package)))
        second["start"].start()
        second["start"].join(timeout=1)  # it waits for this one to be recorded (before, it deleted it meanwhile)

    assert cached_package(package, build) == (package, "")
    second["start"].join()
    assert second["found"] == (package, " (from the cache)")
    assert "damaged" not in capsys.readouterr().err


def test_training_into_a_run_folder_with_a_planted_lock_leaves_its_target_alone(tmp_path, corpus, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).symlink_to(victim)
    done = subprocess.run(
        [sys.executable, "-m", "aftgen", "train", corpus, "--out", run, "--resume"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("error:") == 1, done.stderr
    assert "is a link, not a lock file aftgen made" in done.stderr


@pytest.mark.parametrize("planted", ["README.md", "metrics.jsonl", "curves.png"])
def test_push_never_publishes_a_file_that_a_link_in_the_run_folder_points_to(tmp_path, tiny_run, victim, planted):
    run = tmp_path / "run"
    run.mkdir()
    for name in CHECKPOINT_FILES:
        shutil.copy(tiny_run / name, run)
    if planted != "README.md":  # a curated card: the folder has no training.json, so no metrics are read for one
        (run / "README.md").write_text("# a curated card\n")
    (run / planted).symlink_to(victim)  # a folder from elsewhere, its link pointing at a user's key, say
    with FakeHub() as hub, pytest.MonkeyPatch.context() as env:
        env.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        env.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)  # the fake Hub takes LFS uploads
        with pytest.raises(AftgenError, match=f"{planted}: the (file to publish|model card) is a link, which aftgen"):
            push(run, "mallory/loot")
    assert "mallory/loot" not in hub.repos


def hostile_state_files(folder: Path, suffix: str) -> dict[str, Path]:
    """A session or state file that is a link to a 3 GB sparse file, a link to /dev/zero, or a FIFO."""
    sparse = folder / "sparse"
    with open(sparse, "wb") as handle:
        handle.truncate(3 << 30)
    plants = {"sparse": folder / f"sparse{suffix}", "zero": folder / f"zero{suffix}", "fifo": folder / f"fifo{suffix}"}
    plants["sparse"].symlink_to(sparse)
    plants["zero"].symlink_to("/dev/zero")
    os.mkfifo(plants["fifo"])
    return plants


def test_a_state_file_that_is_no_file_or_too_large_is_refused_before_it_is_read(tmp_path, tiny_run, no_hang):
    model, tokenizer = load(tiny_run, device="cpu")
    refused = {"sparse": "3,221,225,472 bytes, more than it can hold", "zero": "a device", "fifo": "a FIFO"}
    for plant, path in hostile_state_files(tmp_path, ".safetensors").items():
        with pytest.raises(AftgenError, match=f"{path}: the state file is {refused[plant]}"):
            load_state(path, model, tokenizer)


def test_a_state_file_whose_header_is_nested_too_deep_is_refused(tmp_path, tiny_run):
    model, tokenizer = load(tiny_run, device="cpu")
    header = b"[" * 20_000 + b"]" * 20_000  # within the state file's limit; json gives up far sooner
    path = tmp_path / "deep.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(AftgenError, match="deep.safetensors: not an aftgen state file"):
        load_state(path, model, tokenizer)


def test_a_session_file_that_is_no_file_gets_400_and_the_server_goes_on(tmp_path, tiny_run):
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    hostile_state_files(sessions, SUFFIX)
    with running(tiny_run, sessions_dir=sessions) as url:
        before = tree_memory_mb(os.getpid())[0]
        for name in ("sparse", "zero", "fifo"):
            body = {"prompt": "x", "max_tokens": 1, "session": name}
            reply = httpx.post(f"{url}/v1/completions", headers=AUTH, json=body, timeout=5)
            assert reply.status_code == 400 and ("not a regular file" in reply.text or "more than" in reply.text)
        assert tree_memory_mb(os.getpid())[0] - before < 200
        reply = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "KING:", "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200, reply.text


# The scan: a plain open or read/write of a path outside aftgen/files.py is a defect, save these, each with why.
PATH_CALLS = {"read_bytes", "read_text", "write_text", "write_bytes"}
ALLOWED = {
    ("aftgen/serve/app.py", "playground"): "a page shipped in the package (importlib.resources)",
    ("aftgen/cli/common.py", "quiet_stdout"): "os.devnull, once a reader of stdout went away",
    ("aftgen/bench/side_by_side.py", "__init__"): "the child's log, in the bench's own temporary folder",
}


def _opens_a_file(func: ast.expr) -> bool:
    """open(...), os.open(...), or a Path's .read_bytes() and the like (a bare read_text() is the door's)."""
    if isinstance(func, ast.Name):
        return func.id == "open"
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "open":  # a method called open (TokenFiles.open) is not a file's, os.open is
        return isinstance(func.value, ast.Name) and func.value.id == "os"
    return func.attr in PATH_CALLS


def plain_file_calls(source: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of each open(), os.open() or Path read/write in `source`."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call):
                if _opens_a_file(child.func):
                    found.append((name, child.lineno))
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return found


def test_no_file_is_opened_outside_the_files_door():
    root = Path(aftgen.__file__).parent
    plain = []
    for path in sorted(root.rglob("*.py")):
        module = str(path.relative_to(root.parent))
        if module != "aftgen/files.py":
            calls = plain_file_calls(path.read_text())
            plain += [f"{module}:{line} in {name}()" for name, line in calls if (module, name) not in ALLOWED]
    assert plain == [], "open files through aftgen.files (or allow the call here, saying why)"


def test_the_scan_finds_a_plain_open():
    snippet = """
def load(path):
    with open(path) as handle:
        pass
    os.open(path, os.O_RDONLY)
    return Path(path).read_bytes() + path.write_text("x")
def fine(files, path):
    return files.open("train", 3) + read_text(path, 100, "a")  # aftgen's own open method; the door
"""
    assert [line for _, line in plain_file_calls(snippet)] == [3, 5, 6, 6]


def test_a_folder_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(tmp_path):
    from aftgen.files import LOCK, locked_folder

    folder, warnings = tmp_path / "run", []
    folder.mkdir()
    (folder / LOCK).write_text("4242\n")  # left by a process killed while it wrote the folder
    with locked_folder(folder, warnings.append):
        assert warnings == [
            f"warning: {folder} was locked by process 4242, which ended without unlocking it; taking over"
        ]
        assert (folder / LOCK).read_text() == f"{os.getpid()}\n"
        with pytest.raises(
            AftgenError, match=rf"{folder} is being written by another aftgen process \(PID {os.getpid()}\)"
        ):
            with locked_folder(folder, warnings.append):
                pytest.fail("a second writer got in")
        assert (folder / LOCK).read_text() == f"{os.getpid()}\n"  # the refused one left the lock alone
    assert not (folder / LOCK).exists()
    with locked_folder(folder, warnings.append):
        pass
    assert len(warnings) == 1 and folder.is_dir()  # a lock removed at exit is no dead writer's
    with locked_folder(tmp_path / "new", warnings.append):
        assert (tmp_path / "new").is_dir()
    assert not (tmp_path / "new").exists()  # created for work that never wrote anything


def test_atomic_writes_get_the_permissions_a_plain_open_would(tmp_path):
    from aftgen.files import atomic_write

    umask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "new.json", "{}")
        assert (tmp_path / "new.json").stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
        os.chmod(tmp_path / "new.json", 0o640)
        atomic_write(tmp_path / "new.json", "[]")  # replacing keeps the file's own permissions
        assert (tmp_path / "new.json").stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(umask)
