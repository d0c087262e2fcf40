"""Benchmark rows on stdout (an aligned table, rich tables or JSON lines) and as a plot."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from aftgen.bench.targets import SUBJECT, Row
from aftgen.compiled.availability import fallbacks
from aftgen.errors import AftgenError
from aftgen.files import atomic_write


def print_rows(rows: list[Row], as_json: bool) -> None:
    """One JSON object per line, or an aligned table, on stdout; under the table, what fell back from a compiled or
    native path in this run."""
    if as_json:
        for item in rows:
            print(json.dumps(item))
        return
    for item in rows:
        where = ", ".join(
            f"{k} {v}" for k, v in item.items() if k not in ("measure", "value", "unit", "target", "ok", "note")
        )
        verdict = "" if item.get("target") is None else f"  target {item['target']}: {'ok' if item['ok'] else 'MISSED'}"
        note = f"  ({item['note']})" if item.get("note") else ""
        label = item["measure"] + (f" [{where}]" if where else "")
        print(f"{label:<62} {item['value']:>12,.4g} {item['unit']:<9}{verdict}{note}")
    for fallback in fallbacks():  # what these figures ran instead of the compiled or native path
        print(f"fallback: {fallback.line()}")
    sys.stdout.flush()


def print_comparison(rows: list[Row], as_json: bool) -> None:
    """JSON rows on stdout, or rich tables: one column per mixer, plus aft_local against attention."""
    if as_json:
        print_rows(rows, True)
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    measured = [r for r in rows if "mixer" in r]
    mixers = list(dict.fromkeys(r["mixer"] for r in measured))
    table = Table(title="aftgen bench: every mixer at the same width and depth")
    for column in ("measure", "at", *mixers, "aft_local vs attention"):
        table.add_column(column, justify="left" if column in ("measure", "at") else "right")
    groups: dict[tuple, dict] = {}
    for r in measured:
        at = next(
            (
                f"{k} {r[k]:,}" if isinstance(r[k], int) else f"{k} {r[k]}"
                for k in ("length", "context", "tokens")
                if k in r
            ),
            "",
        )
        groups.setdefault((f"{r['measure']} ({r['unit']})", at), {})[r["mixer"]] = r
    for (measure, at), by_mixer in groups.items():
        ours = by_mixer.get(SUBJECT, {}).get("vs_attention")
        versus = "" if ours is None else (f"{ours:+.4f}" if measure.startswith("held-out (") else f"{ours:.2f}x")
        cells = [f"{by_mixer[m]['value']:,.4g}" if m in by_mixer else "" for m in mixers]
        table.add_row(measure, at, *cells, versus)
    console.print(table)
    checks = [r for r in rows if "target" in r]
    if checks:
        verdicts = Table(title="targets")
        for column in ("target", "measured", "goal", ""):
            verdicts.add_column(column)
        for r in checks:
            verdicts.add_row(r["measure"], f"{r['value']:.3g}", r["target"], "ok" if r["ok"] else "MISSED")
        console.print(verdicts)


def pyplot():
    """matplotlib's pyplot, drawing to files only; checked before a benchmark starts, not after it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AftgenError("--plot needs matplotlib: pip install 'aftgen[plot]'") from None
    return plt


def plot_comparison(rows: list[Row], path: Path) -> None:
    """Training speed and memory by length, decode latency by context: one PNG, written atomically."""
    plt = pyplot()
    panels = [("train step", "length"), ("train peak memory", "length"), ("decode step", "context")]
    panels = [(m, k) for m, k in panels if any(r["measure"] == m for r in rows)]
    if not panels:
        raise AftgenError("nothing to plot: --plot draws the train and decode rows")
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (measure, key) in zip(axes[0], panels, strict=True):
        chosen = [r for r in rows if r["measure"] == measure]
        for mixer in dict.fromkeys(r["mixer"] for r in chosen):
            points = [(r[key], r["value"]) for r in chosen if r["mixer"] == mixer]
            axis.plot(*zip(*points, strict=True), marker="o", label=mixer)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("sequence length" if key == "length" else "context (tokens)")
        axis.set_ylabel(chosen[0]["unit"])
        axis.set_title(measure)
        axis.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    atomic_write(path, buffer.getvalue())
