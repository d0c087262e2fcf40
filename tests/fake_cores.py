"""A fake view of the machine for the CPU-thread tests: a clock moved by hand, and another aftgen process."""

from __future__ import annotations

import os

from aftgen.cores import Registry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def peer(tmp_path, command: str = "serve", busy: bool = True) -> Registry:
    """Another aftgen process: the test runner's parent, which is alive for as long as the test runs."""
    registry = Registry(tmp_path, pid=os.getppid())
    registry.write(command, busy)
    return registry
