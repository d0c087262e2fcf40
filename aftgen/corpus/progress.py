"""Preparation progress on stderr: a rich bar (MB read, MB/s, time left) on a terminal, plain lines otherwise."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

LINE_EVERY = 15.0  # seconds between plain progress lines

Advance = Callable[[int], None]  # told each number of bytes read


class Meter:
    """Shows how far each phase of a preparation has read; `show` False keeps quiet."""

    def __init__(self, show: bool = True, bar: bool | None = None):
        self.show = show
        self.bar = show and (sys.stderr.isatty() if bar is None else bar)

    @contextlib.contextmanager
    def phase(self, description: str, total: int) -> Iterator[Advance]:
        """A phase that will read about `total` bytes: yields the function to tell it what was read."""
        if not self.show:
            yield lambda _: None
        elif self.bar:
            with _bar(description, total) as advance:
                yield advance
        else:
            yield from _lines(description, total)

    def log(self, message: str) -> None:
        if self.show:
            print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _bar(description: str, total: int) -> Iterator[Advance]:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description:<10}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, TimeRemainingColumn(), console=Console(stderr=True)) as progress:
        task = progress.add_task(description, total=total)
        yield lambda read: progress.advance(task, read)
        progress.update(task, completed=total)


def _lines(description: str, total: int) -> Iterator[Advance]:
    start = last = time.monotonic()
    done = 0

    def advance(read: int) -> None:
        nonlocal done, last
        done += read
        now = time.monotonic()
        if now - last >= LINE_EVERY:
            last = now
            rate = done / max(now - start, 1e-9)
            left = f", {max(total - done, 0) / rate:,.0f} s left" if rate and total else ""
            print(
                f"{description}: {done / 1e6:,.0f} / {total / 1e6:,.0f} MB, {rate / 1e6:.1f} MB/s{left}",
                file=sys.stderr,
            )

    yield advance
    seconds = time.monotonic() - start
    print(f"{description}: {done / 1e6:,.1f} MB in {seconds:.1f} s ({done / 1e6 / max(seconds, 1e-9):.1f} MB/s)",
          file=sys.stderr, flush=True)  # fmt: skip
