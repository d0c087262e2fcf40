"""Benchmark rows as the user sees them (aftgen/bench/report.py): an aligned table with verdicts, JSON lines,
a table per mixer, and a plot."""

from __future__ import annotations

import json

import pytest

from aftgen.bench.report import plot_comparison, print_comparison, print_rows
from aftgen.errors import AftgenError

ROWS = [
    {"measure": "step latency", "context": 1024, "value": 0.31234, "unit": "ms"},
    {"measure": "latency growth", "value": 1.5, "unit": "x", "target": "<= 1.1", "ok": False, "note": "busy"},
    {"measure": "memory growth", "value": 2.0, "unit": "MB", "target": "<= 5", "ok": True},
]
COMPARED = [
    {
        "measure": "train step",
        "mixer": mixer,
        "length": length,
        "value": value,
        "unit": "tokens/s",
        "vs_attention": ratio,
    }
    for mixer, length, value, ratio in [
        ("aft_local", 256, 3000.0, 1.5),
        ("attention", 256, 2000.0, 1.0),
        ("aft_local", 1024, 2500.0, 2.5),
        ("attention", 1024, 1000.0, 1.0),
    ]
] + [{"measure": "decode step", "mixer": "aft_local", "context": 1024, "value": 0.4, "unit": "ms"}]


def test_rows_are_an_aligned_table_with_their_verdicts_or_json_lines(capsys):
    print_rows(ROWS, as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "latency", "[context", "1024]", "0.3123", "ms"]
    assert lines[1].endswith("target <= 1.1: MISSED  (busy)") and lines[2].endswith("target <= 5: ok")
    assert [line[63:75].strip() for line in lines] == ["0.3123", "1.5", "2"]  # the values end in one column
    print_rows(ROWS, as_json=True)
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == ROWS


def test_the_comparison_has_a_column_per_mixer_and_aft_local_against_attention(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich fits its tables to the terminal's width
    print_comparison(COMPARED, as_json=False)
    rows = [line for line in capsys.readouterr().out.splitlines() if "train step" in line]
    assert [[cell.strip() for cell in row.split("│")[1:-1]] for row in rows] == [
        ["train step (tokens/s)", "length 256", "3,000", "2,000", "1.50x"],
        ["train step (tokens/s)", "length 1,024", "2,500", "1,000", "2.50x"],
    ]
    print_comparison(COMPARED, as_json=True)
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == COMPARED


def test_the_plot_draws_the_train_and_decode_rows_and_refuses_others(tmp_path):
    plot_comparison(COMPARED, tmp_path / "mixers.png")
    assert (tmp_path / "mixers.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(AftgenError, match="nothing to plot"):
        plot_comparison(ROWS, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
