"""`aftgen bench`'s commands (aftgen/cli/bench.py): bad choices are one line, before any benchmark runs."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from aftgen.cli import app
from aftgen.model import PRESETS


def test_bench_quality_refuses_a_missing_corpus_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["bench", "quality", str(tmp_path / "nope.txt"), "--time", "1"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"error: {tmp_path / 'nope.txt'}: no such file"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "huge"], f"error: unknown preset 'huge'; choose one of: {', '.join(PRESETS)}"),
        (["--preset", "tiny", "--model", "x"], "error: give --model or --preset, not both"),
    ],
)
def test_bench_generate_refuses_bad_model_choices_in_one_line(args, message):
    result = CliRunner().invoke(app, ["bench", "generate", *args])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [message]


def test_plot_without_matplotlib_is_refused_before_any_benchmark(monkeypatch, tmp_path):
    import sys

    from aftgen.bench import mixers

    ran = []
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setattr(mixers, "bench_train", lambda *a, **k: ran.append(1) or [])
    result = CliRunner().invoke(app, ["bench", "train", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["error: --plot needs matplotlib: pip install 'aftgen[plot]'"]
    assert not ran
