"""CPU threads shared among aftgen processes: the decision, on a fake view of the machine (a registry folder
of our own, a clock we move by hand); nothing here is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from fake_cores import Clock, peer

from aftgen import cores
from aftgen.cores import IDLE_AFTER, LOOK_EVERY, Registry, ThreadShare, fair_share


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def share(tmp_path, count: int = 2, **options) -> tuple[ThreadShare, list[str], Clock]:
    said, clock = [], Clock()
    return ThreadShare(Registry(tmp_path), "train", count, say=said.append, clock=clock, **options), said, clock


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_the_cores_are_split_evenly_and_the_first_pids_take_the_remainder():
    assert fair_share(2, [7], 7, most=2) == 2
    assert fair_share(2, [7, 9], 7, most=2) == fair_share(2, [7, 9], 9, most=2) == 1
    assert [fair_share(4, [3, 5, 8], pid, most=4) for pid in (3, 5, 8)] == [2, 1, 1]
    assert fair_share(2, [1, 2, 3], 3, most=2) == 1  # more processes than cores: one thread each, never none
    assert fair_share(8, [7], 7, most=3) == 3  # a server keeps cores for its HTTP side


def test_the_registry_lists_the_living_and_removes_the_dead(tmp_path):
    Registry(tmp_path).write("train", busy=True)
    peer(tmp_path, "serve", busy=False)
    Registry(tmp_path, pid=dead_pid()).write("eval", busy=True)
    (tmp_path / "notes.json").write_text("[1, 2")  # not an entry: ignored and left alone
    found = {p.pid: (p.command, p.busy) for p in Registry(tmp_path).peers()}
    assert found == {os.getpid(): ("train", True), os.getppid(): ("serve", False)}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{os.getpid()}.json", f"{os.getppid()}.json", "notes.json"]
    )


def test_a_reused_pid_is_not_taken_for_the_process_that_registered(tmp_path):
    registry = peer(tmp_path)
    record = json.loads(registry.entry.read_text())
    registry.entry.write_text(json.dumps(record | {"started": "1"}))  # same PID, another start time
    assert Registry(tmp_path).peers() == []


def test_alone_a_process_takes_every_core_and_says_nothing(tmp_path):
    threads_share, said, _ = share(tmp_path)
    assert threads_share.look() == 2 and torch.get_num_threads() == 2
    assert said == []


def test_beside_a_busy_process_it_takes_half_and_gets_it_back_when_that_one_ends(tmp_path):
    threads_share, said, clock = share(tmp_path)
    threads_share.look()
    other = peer(tmp_path, "serve")
    clock.now += LOOK_EVERY / 2
    threads_share.adapt()
    assert torch.get_num_threads() == 2  # not looked again yet: a look is due every LOOK_EVERY seconds
    clock.now += LOOK_EVERY / 2
    threads_share.adapt()
    assert torch.get_num_threads() == 1
    assert said == [f"threads: 1 of 2 cores, shared with aftgen serve (pid {os.getppid()})"]
    other.leave()
    clock.now += LOOK_EVERY
    threads_share.adapt()
    assert torch.get_num_threads() == 2 and "again" in said[-1]


def test_a_process_that_says_it_is_busy_but_uses_no_cpu_is_not_counted(tmp_path):
    threads_share, _, clock = share(tmp_path)
    peer(tmp_path, "train")  # the test runner's parent waits for it: it uses no CPU
    assert threads_share.look() == 1  # first sight: taken at its word
    clock.now += LOOK_EVERY
    assert threads_share.look() == 2


def test_an_idle_process_leaves_every_core_to_the_others(tmp_path):
    threads_share, _, _ = share(tmp_path)
    peer(tmp_path, "serve", busy=False)
    assert threads_share.look() == 2


def test_a_server_gives_its_share_back_only_after_a_second_without_work(tmp_path):
    server, _, clock = share(tmp_path, reserve=1, busy=False)
    server.command = "serve"
    assert server.look() == 1  # alone, it keeps a core for the HTTP side
    server.adapt(busy=True)
    assert _entry(server)["busy"] is True
    server.adapt(busy=False)
    clock.now += IDLE_AFTER / 2
    server.adapt(busy=False)
    assert _entry(server)["busy"] is True  # a pause between two requests
    clock.now += IDLE_AFTER
    server.adapt(busy=False)
    assert _entry(server)["busy"] is False


def test_threads_given_by_the_user_win_and_still_make_the_others_make_room(tmp_path):
    fixed, said, _ = share(tmp_path, fixed=2)
    other = ThreadShare(Registry(tmp_path, pid=os.getppid()), "train", 2, say=said.append)
    assert fixed.look() == 2
    assert other.look() == 1
    assert said == [f"threads: 1 of 2 cores, shared with aftgen train (pid {os.getpid()})"]


def test_torchruns_processes_share_the_cores_before_they_have_registered(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    threads_share, said, _ = share(tmp_path)
    assert threads_share.look() == 1
    assert said == ["threads: 1 of 2 cores, shared among torchrun's 2 processes"]


def test_without_a_writable_cache_a_process_takes_every_core(tmp_path):
    (tmp_path / "file").write_text("")
    threads_share = ThreadShare(Registry(tmp_path / "file" / "running"), "train", 2, say=print)
    assert threads_share.look() == 2


def test_claim_joins_the_registry_under_the_cache_and_leaves_it(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "_share", None)
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path))
    monkeypatch.delenv(cores.SOLO_VARIABLE, raising=False)
    cores.claim("eval")
    entry = tmp_path / "running" / f"{os.getpid()}.json"
    assert json.loads(entry.read_text())["command"] == "eval"
    cores._leave()
    assert not entry.exists()


def _entry(threads_share: ThreadShare) -> dict:
    return json.loads(threads_share.registry.entry.read_text())


def hostile_entries(folder, live_pid: int) -> None:
    """What the audit planted in the registry: a FIFO, a JSON nested 100,000 deep, a live process's entry whose
    command is 50 MB, and an entry whose PID is JSON's true (PID 1 to Python: alive, and busy for good)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.mkfifo(folder / "99999.json")
    (folder / "99998.json").write_text("[" * 100_000 + "]" * 100_000)
    (folder / f"{live_pid}.json").write_text(json.dumps({"pid": live_pid, "command": "x" * 50_000_000, "busy": True}))
    (folder / "1.json").write_text(json.dumps({"pid": True, "busy": True}))


def test_entries_that_are_not_entries_are_removed_without_hanging(tmp_path, no_hang):
    hostile_entries(tmp_path, os.getppid())
    live = {"pid": os.getppid(), "started": None, "command": "serve"}
    for name, record in {
        "2.json": live,  # not the PID its name says
        "3.json": live | {"pid": "3"},
        "4.json": live | {"busy": 1},
        "5.json": live | {"command": ["serve"]},
        "9999999.json": live | {"pid": 9999999},  # beyond any pid_max
    }.items():
        (tmp_path / name).write_text(json.dumps(record | {"busy": record.get("busy", True)}))
    (tmp_path / "notes.json").write_text("[1, 2")  # not named like an entry: not ours to judge, left alone
    assert Registry(tmp_path).peers() == []
    assert [p.name for p in tmp_path.iterdir()] == ["notes.json"]


def test_a_link_planted_in_the_registry_is_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    folder = tmp_path / "running"
    folder.mkdir()
    registry = Registry(folder)
    (folder / f".{registry.pid}.partial").symlink_to(victim)
    registry.write("train", busy=True)
    registry.entry.unlink()
    registry.entry.symlink_to(victim)
    registry.write("train", busy=False)
    assert victim.read_text() == "precious"
    assert json.loads(registry.entry.read_text())["busy"] is False


def test_a_peers_command_is_shown_without_control_characters_and_cut(tmp_path):
    threads_share, said, _ = share(tmp_path)
    peer(tmp_path, "serve \x1b]0;owned\x07\x1b[2J" * 1000)
    threads_share.look()
    assert len(said) == 1 and said[0].isprintable() and len(said[0]) < 200


def test_a_hostile_registry_leaves_a_command_every_core(tmp_path, no_hang):
    """The issue's bar: with the audit's entries in the registry, `aftgen sample` ends quickly and cleanly, and
    takes every core (a command that shares them says so on stderr)."""
    hostile_entries(tmp_path / "running", os.getpid())
    env = {k: v for k, v in os.environ.items() if k != cores.SOLO_VARIABLE} | {"AFTGEN_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "aftgen", "sample", "-n", "5"], capture_output=True, env=env, timeout=30
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stderr) < 10_000 and b"threads:" not in done.stderr
    assert done.stderr.decode().replace("\n", "").isprintable()


def written_by_another_hand(pid: int) -> dict[str, object]:
    """Entries for the live process `pid` as an older aftgen wrote them (no start time) or as a careless hand
    would: each is to be ignored and removed, none may end a command."""
    entry = {"pid": pid, "started": cores._start_time(pid), "command": "serve", "busy": True}
    return {
        "no start time": {k: v for k, v in entry.items() if k != "started"},
        "a start time of null": entry | {"started": None},
        "another start time": entry | {"started": "not a time"},
        "busy a number": entry | {"busy": 1},
        "a negative pid": entry | {"pid": -pid},
        "a pid of 1e30": entry | {"pid": 1e30},
        "null": None,
        "a list": [entry],
        "a string": "serve",
    }


@pytest.mark.parametrize("kind", written_by_another_hand(1))
def test_an_entry_from_another_version_or_hand_is_ignored_and_removed(tmp_path, kind):
    (tmp_path / f"{os.getppid()}.json").write_text(json.dumps(written_by_another_hand(os.getppid())[kind]))
    assert Registry(tmp_path).peers() == []
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def sleepers():
    """Live processes to name entries after, one per kind of entry."""
    processes = [subprocess.Popen(["sleep", "60"]) for _ in written_by_another_hand(1)]
    yield [process.pid for process in processes]
    for process in processes:
        process.kill()
        process.wait()


def test_entries_from_another_version_or_hand_leave_a_command_every_core(tmp_path, sleepers, no_hang):
    """The issue's bar: with such entries in the registry, each named after a live process, `aftgen sample` ends
    quickly and cleanly, takes every core and removes them."""
    folder = tmp_path / "running"
    folder.mkdir()
    for pid, kind in zip(sleepers, written_by_another_hand(1), strict=True):
        (folder / f"{pid}.json").write_text(json.dumps(written_by_another_hand(pid)[kind]))
    env = {k: v for k, v in os.environ.items() if k != cores.SOLO_VARIABLE} | {"AFTGEN_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "aftgen", "sample", "-p", "ROMEO:", "-n", "5"], capture_output=True, env=env, timeout=30
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert b"threads:" not in done.stderr and list(folder.iterdir()) == []
