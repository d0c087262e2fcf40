"""Training curves as pictures: a run folder's curves.png, and several runs overlaid (`aftgen plot`).

Drawn from metrics.jsonl with matplotlib's Agg renderer (no display needed), which the `plot` extra
installs; without it training goes on and says once how to get the picture.
"""

from __future__ import annotations

import importlib.util
import io
import time
from pathlib import Path

from aftgen.errors import AftgenError
from aftgen.files import atomic_write
from aftgen.record import read_run_files

CURVES = "curves.png"
CURVES_LIMIT = 64 << 20  # bytes: the picture of a run's curves is about 100 KB
INSTALL_HINT = "pip install 'aftgen[plot]'"
MISSING = f"note: matplotlib is not installed, so no {CURVES} is drawn; {INSTALL_HINT} to get the picture"
RAW = "raw_weights_held_out_nats_per_char"
DRAWING_SHARE = 0.1  # of a run's time, at most, spent redrawing its curves
FIRST_DRAWING_GUESS = 0.5  # seconds a drawing takes (a 2-core CPU), until one has been timed


class LiveCurves:
    """A run's curves.png, redrawn at held-out checks as long as drawing takes at most a tenth of the
    run's time: with a check every few seconds or more, at every one, so a user can open it while the
    run goes on; a tiny run checking every few milliseconds draws once, at the end (`flush`)."""

    def __init__(self, folder: Path):
        self.folder, self.metrics, self.drawn = Path(folder), [], 0
        self.started, self.spent, self.cost = time.monotonic(), 0.0, FIRST_DRAWING_GUESS

    def checked(self, metrics: list[dict]) -> None:
        self.metrics = metrics
        if self.spent + self.cost <= DRAWING_SHARE * (time.monotonic() - self.started):
            self.flush()

    def flush(self) -> None:
        """Draw the checks not drawn yet."""
        if self.drawn == len(self.metrics):
            return
        start = time.monotonic()
        save_curves(self.folder, self.metrics)
        self.drawn, self.cost = len(self.metrics), time.monotonic() - start
        self.spent += self.cost


def available() -> bool:
    """Whether matplotlib is installed (without importing it: that takes a second)."""
    return importlib.util.find_spec("matplotlib") is not None


def save_curves(folder: Path, metrics: list[dict]) -> None:
    """Draw one run's curves into `folder`/curves.png (atomically: a viewer never sees half a file)."""
    atomic_write(Path(folder) / CURVES, _png(curves_figure([(Path(folder).name, metrics)])))


def plot_runs(folders: list[Path], out: Path) -> None:
    """Overlay the curves of several run folders, labelled by folder name, in one PNG at `out`."""
    if not available():
        raise AftgenError(f"aftgen plot needs matplotlib, which is not installed: {INSTALL_HINT}")
    atomic_write(out, _png(curves_figure(read_runs(folders))))


def read_runs(folders: list[Path]) -> list[tuple[str, list[dict]]]:
    """(folder name, held-out checks) of each run folder; a folder without checks is refused."""
    runs = []
    for folder in folders:
        if not Path(folder).is_dir():
            raise AftgenError(f"{folder}: no such run folder")
        metrics = read_run_files(Path(folder))[1]
        if not metrics:
            raise AftgenError(f"{folder}: no held-out checks yet (metrics.jsonl is missing or empty)")
        runs.append((Path(folder).resolve().name, metrics))
    return runs


def curves_figure(runs: list[tuple[str, list[dict]]]):
    """A matplotlib Figure of (label, held-out checks) runs, one colour each, in four panels: train loss
    and held-out nats/char by step, held-out nats/char by wall time, the learning rate."""
    from matplotlib.figure import Figure  # the object API: no pyplot, no global state, no GUI backend

    figure = Figure(figsize=(11, 7.5))
    figure.subplots_adjust(left=0.07, right=0.98, top=0.95, bottom=0.08, hspace=0.3, wspace=0.18)
    (train, held), (clock, lr) = figure.subplots(2, 2)
    for color, (label, rows) in zip(_colors(len(runs)), runs, strict=True):
        _line(train, rows, "step", "train_loss", label, color)
        _line(held, rows, "step", "held_out_nats_per_char", label, color)
        _line(held, rows, "step", RAW, f"{label} (raw weights)", color, linestyle="--")
        _line(clock, rows, "elapsed", "held_out_nats_per_char", label, color)
        _line(lr, rows, "step", "lr", label, color)
    titles = [
        (train, "train loss (nats/token)", "step"),
        (held, "held-out nats/char" + (" (dashed: raw weights beside the average)" if _any(runs, RAW) else ""), "step"),
        (clock, "held-out nats/char", "wall time (s)"),
        (lr, "learning rate", "step"),
    ]
    for axes, title, xlabel in titles:
        axes.set_title(title, fontsize=10)
        axes.set_xlabel(xlabel)
        axes.grid(alpha=0.3)
        if axes.has_data() and (len(runs) > 1 or axes is held):
            axes.legend(fontsize=8)
    return figure


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    return buffer.getvalue()


def _line(axes, rows: list[dict], x: str, y: str, label: str, color, linestyle: str = "-") -> None:
    points = [(row[x], row[y]) for row in rows if row.get(y) is not None and row.get(x) is not None]
    if points:
        xs, ys = zip(*points, strict=True)
        axes.plot(xs, ys, marker="." if len(points) < 30 else None, label=label, color=color, linestyle=linestyle)


def _any(runs: list[tuple[str, list[dict]]], key: str) -> bool:
    return any(row.get(key) is not None for _, rows in runs for row in rows)


def _colors(count: int) -> list:
    from matplotlib import colormaps

    return [colormaps["tab10"](i % 10) for i in range(count)]
