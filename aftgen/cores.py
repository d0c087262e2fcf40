"""The CPU cores shared with the other aftgen processes on the machine, instead of fought over.

torch gives a process one thread per core, and its OpenMP threads spin while they wait for work. Two
processes that each take every core then take turns badly on every small operation: two trainings side
by side on 2 cores made 0.03x the steps of one alone. A blanket passive wait policy cures that but costs a
process alone half its speed. So each aftgen process that computes writes a small entry in a registry
under the cache folder (`running/<pid>.json`), counts the live ones that are busy, and takes its share of
the physical cores: alone, all of them; beside another, half. Then no thread ever waits for a core, and
spinning costs nothing. Long loops (a training step, a generated token, a server's turn) call `adapt()`,
which looks again every few seconds and follows the change, so a run gets its cores back when the other
one ends, and a server gives its share back while no request runs. `--threads N` fixes the count.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
import torch

from aftgen.errors import AftgenError
from aftgen.files import atomic_write, cache_dir, read_bytes, read_record, shown

SOLO_VARIABLE = "AFTGEN_SOLO"  # set: every core and no registry (the behaviour before it; a bench of one job alone)
LOOK_EVERY = 2.0  # seconds between two looks at the registry: a look is cheap, a wrong share far dearer
IDLE_CPU = 0.2  # cores: a peer that says it is busy but used less than this since the last look is not (a
# process that ran an aftgen command in-process and went on with other things, a chat waiting for its user)
IDLE_AFTER = 1.0  # seconds without work before a server gives its share back (a client's next request is quick)
ENTRY_LIMIT = 64 << 10  # bytes: an entry aftgen writes is under 4 KB; anything larger was not written by it
PID_MAX = 1 << 22  # the most Linux's pid_max can be
_ENTRY_NAME = re.compile(r"([0-9]{1,7})\.json")  # "<pid>.json": any other name in the folder is not ours to judge


class Entry(msgspec.Struct, frozen=True):
    """A process's registry entry, `running/<pid>.json`, as `Registry.write` writes it."""

    pid: Annotated[int, msgspec.Meta(gt=0, le=PID_MAX)]
    started: str | None = None  # its start time (`_start_time`); an entry without one is never trusted
    command: str = "?"
    busy: bool = True  # unsaid: counted as computing while it uses the CPU (ThreadShare._working)


@dataclass(frozen=True)
class Peer:
    """An aftgen process in the registry."""

    pid: int
    command: str
    busy: bool  # what the process says of itself
    cpu_seconds: float | None  # the CPU time it has used so far (None where /proc cannot tell)


def fair_share(cores: int, busy_pids: list[int], pid: int, most: int) -> int:
    """This process's threads: the cores split evenly among the busy processes (the first ones in PID order
    take one more where they do not divide), at most `most`, at least one."""
    others = sorted(p for p in busy_pids if p != pid)
    index, count = sum(p < pid for p in others), len(others) + 1
    share = cores // count + (index < cores % count)
    return max(1, min(most, share))


class Registry:
    """The aftgen processes on this machine: one JSON file per process, named by its PID."""

    def __init__(self, folder: Path, pid: int | None = None) -> None:
        self.folder, self.pid = folder, pid or os.getpid()

    @property
    def entry(self) -> Path:
        return self.folder / f"{self.pid}.json"

    def write(self, command: str, busy: bool) -> None:
        """Add or update this process's entry (written whole beside it, then renamed: a reader never sees half,
        and a link planted in the folder is replaced, never written through). Not fsynced: that would stall a
        server's first request after a pause, and an entry is worth nothing once its process is gone."""
        record = {"pid": self.pid, "started": _start_time(self.pid), "command": command, "busy": busy}
        atomic_write(self.entry, json.dumps(record), durable=False)

    def leave(self) -> None:
        with contextlib.suppress(OSError):
            self.entry.unlink()

    def peers(self) -> list[Peer]:
        """The live processes' entries, this one's too. The entries of processes that have died are removed,
        and so is anything named like an entry that is not one (a FIFO, a huge or malformed file): aftgen
        never writes one, and left there it would be read again on every look. So is one whose start time cannot
        be checked against its live process (none recorded, as an older aftgen wrote them): its PID may be reused."""
        found = []
        for path in self.folder.glob("*.json"):
            if not (name := _ENTRY_NAME.fullmatch(path.name)):
                continue
            entry = _read(path, int(name[1]))
            if entry is None or not _alive(entry.pid, entry.started):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            found.append(Peer(entry.pid, entry.command, entry.busy, _cpu_seconds(entry.pid)))
        return found


def _read(path: Path, pid: int) -> Entry | None:
    """The entry of process `pid`, or None for one that is not a regular file of a valid entry for it."""
    try:
        entry = read_record(path, Entry, ENTRY_LIMIT, "the registry entry")
    except AftgenError:
        return None
    return entry if entry.pid == pid else None


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the third on (Linux; empty elsewhere): the name before them may hold spaces."""
    try:
        return read_bytes(f"/proc/{pid}/stat", 4096, "the process's status").decode().rpartition(")")[2].split()
    except (AftgenError, UnicodeDecodeError):
        return []


def _start_time(pid: int) -> str | None:
    """When `pid` started, in clock ticks since boot, so that a reused PID is not taken for the old process."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else None  # field 22


def _cpu_seconds(pid: int) -> float | None:
    """The user and system CPU time `pid` has used so far (fields 14 and 15)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if len(fields) > 12 else None


def _alive(pid: int, started: str | None) -> bool:
    """Whether `pid` is the very process that wrote the entry: alive, and started when the entry says."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return started is not None and _start_time(pid) == started


class ThreadShare:
    """This process's CPU threads: `fixed` if the user chose them, else its fair share of the cores."""

    def __init__(
        self,
        registry: Registry | None,
        command: str,
        cores: int,
        fixed: int | None = None,
        reserve: int = 0,
        busy: bool = True,
        say: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry, self.command, self.cores, self.fixed = registry, command, cores, fixed
        self.pid = registry.pid if registry is not None else os.getpid()
        self.most = max(1, cores - reserve)  # a server keeps a core for its HTTP side
        self.busy, self.say, self.clock = busy, say or _to_stderr, clock
        self.idle_since: float | None = None
        self.threads, self.looked, self.reason = 0, float("-inf"), ""
        self.seen: dict[int, tuple[float, float]] = {}  # a peer's PID: when it was last looked at, its CPU seconds
        if registry is not None:
            with contextlib.suppress(AftgenError):  # a cache folder that cannot be written: every core, as before
                registry.write(command, busy)

    def look(self) -> int:
        """Count the busy processes now and take this one's share; returns the threads chosen."""
        self.looked = self.clock()
        threads = self.fixed or self._share()
        if threads != self.threads:
            torch.set_num_threads(threads)
            if threads < self.most and self.reason:
                self.say(f"threads: {threads} of {self.cores} cores, {self.reason}")
            elif self.threads:
                self.say(f"threads: {threads} of {self.cores} cores again, now that the machine is free")
            self.threads = threads
        return threads

    def _share(self) -> int:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's processes, before they register
        peers = self._peers()
        others = [p for p in peers if p.pid != self.pid and self._working(p)]
        pids = [p.pid for p in others] + [self.pid]
        if len(pids) < local_world:
            self.reason = f"shared among torchrun's {local_world} processes"
            return max(1, min(self.most, self.cores // local_world))
        self.reason = "shared with " + ", ".join(f"aftgen {shown(p.command, 60)} (pid {p.pid})" for p in others)
        return fair_share(self.cores, pids, self.pid, self.most)

    def _working(self, peer: Peer) -> bool:
        """Whether a peer computes: it says so, and it used at least IDLE_CPU cores since the last look (if any)."""
        now, before = self.clock(), self.seen.get(peer.pid)
        if peer.cpu_seconds is not None:
            self.seen[peer.pid] = (now, peer.cpu_seconds)
        if not peer.busy or before is None or peer.cpu_seconds is None or now <= before[0]:
            return peer.busy
        return (peer.cpu_seconds - before[1]) / (now - before[0]) >= IDLE_CPU

    def _peers(self) -> list[Peer]:
        if self.registry is None:
            return []
        try:
            return self.registry.peers()
        except OSError:
            return []

    def adapt(self, busy: bool | None = None) -> None:
        """Called often from a loop that computes: say whether there is work (a server), and every LOOK_EVERY
        seconds take this process's share again. Costs a clock read when nothing is due."""
        now = self.clock()
        if busy is not None:
            if busy or self.idle_since is None:
                self.idle_since = None if busy else now
            if busy != self.busy and (busy or now - self.idle_since >= IDLE_AFTER):
                self.mark(busy)
        if now - self.looked >= LOOK_EVERY:
            self.look()

    def idle_for(self) -> float | None:
        """Seconds a process without work may sleep before adapt() has something to do (give its share back,
        IDLE_AFTER after its work ended); None once it has (its next work takes a share at once)."""
        if not self.busy:
            return None
        since = self.clock() if self.idle_since is None else self.idle_since
        return max(0.0, since + IDLE_AFTER - self.clock())

    def mark(self, busy: bool) -> None:
        """Tell the others whether this process computes now; one that starts work takes its share at once."""
        self.busy = busy
        if self.registry is not None:
            with contextlib.suppress(AftgenError):
                self.registry.write(self.command, busy)
        if busy:
            self.look()

    def leave(self) -> None:
        if self.registry is not None:
            self.registry.leave()


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_share: ThreadShare | None = None


def set_up(command: str, fixed: int | None = None, reserve: int = 0, busy: bool = True) -> int:
    """What a process does before its first torch work, since torch fixes its threads then: freed memory kept
    for reuse (device.reuse_freed_memory), and its share of the cores claimed (claim); returns its threads."""
    from aftgen.device import reuse_freed_memory

    reuse_freed_memory()
    return claim(command, fixed, reserve, busy)


def claim(command: str, fixed: int | None = None, reserve: int = 0, busy: bool = True) -> int:
    """Join the registry as `command` and set torch's threads to this process's share; returns them.

    `fixed`: the user's --threads (still registered, so that the others make room). `reserve`: cores left
    to other work in this process. `busy=False`: a process that waits for work (a server) and says when it
    has some, through adapt(busy=...)."""
    global _share
    from aftgen.device import physical_cores

    _leave()
    registry = None if os.environ.get(SOLO_VARIABLE) else Registry(cache_dir() / "running")
    _share = ThreadShare(registry, command, physical_cores(), fixed, reserve, busy)
    return _share.look()


def look() -> int:
    """This process's share of the cores now, taken at once (not at adapt()'s next look): what a measurement of
    the machine's speed must run with. Before claim(), torch's threads as they are."""
    return _share.look() if _share is not None else torch.get_num_threads()


def adapt(busy: bool | None = None) -> None:
    """Follow the other processes' comings and goings (ThreadShare.adapt); a no-op before claim()."""
    if _share is not None:
        _share.adapt(busy)


def idle_for() -> float | None:
    """Seconds a loop without work may sleep before it calls adapt() (ThreadShare.idle_for); None: until it
    has work again."""
    return _share.idle_for() if _share is not None else None


@atexit.register
def _leave() -> None:
    if _share is not None:
        _share.leave()
