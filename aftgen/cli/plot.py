"""`aftgen plot`: several runs' training curves overlaid in one picture, to compare recipes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from aftgen.cli.common import command
from aftgen.curves import CURVES
from aftgen.record import METRICS


@command
def plot(
    runs: Annotated[list[Path], typer.Argument(help=f"Run folders (each with its {METRICS}).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="PNG file to write.")] = Path(CURVES),
) -> None:
    """Overlay the training curves of runs, labelled by folder: train loss, held-out nats/char, learning rate."""
    from aftgen.curves import plot_runs

    plot_runs(runs, out)
    print(f"wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''})", file=sys.stderr)
