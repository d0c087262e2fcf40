"""What a training run shows and hears: progress on stderr, and Ctrl-C / SIGTERM as a request to stop."""

from __future__ import annotations

import signal
import sys


class Reporter:
    """Progress on stderr: a rich progress bar on a terminal, plain log lines otherwise."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.live = sys.stderr.isatty() and not quiet
        self.progress = None
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("step {task.fields[step]:>6}"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.task = self.progress.add_task("train", total=1.0, status="", step=0)

    def __enter__(self) -> Reporter:
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress:
            self.progress.stop()

    def log(self, message: str) -> None:
        if self.quiet:
            return
        if self.progress:
            self.progress.console.print(message)
        else:
            print(message, file=sys.stderr, flush=True)

    def update(self, step: int, progress: float, status: str) -> None:
        if self.progress:
            self.progress.update(self.task, completed=min(progress, 1.0), status=status, step=step)


class Interrupts:
    """First SIGINT/SIGTERM asks the loop to save and stop; a second one stops at once."""

    def __init__(self) -> None:
        self.requested: str | None = None

    def __enter__(self) -> Interrupts:
        self.previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in self.previous:
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
