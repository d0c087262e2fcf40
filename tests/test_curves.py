"""Training curves: curves.png drawn at every held-out check of a run, and `aftgen plot` overlaying runs."""

from __future__ import annotations

import math
import sys

import pytest
from conftest import train_tiny
from matplotlib.image import imread
from typer.testing import CliRunner

from aftgen import curves
from aftgen.cli import app
from aftgen.curves import CURVES, MISSING, curves_figure, read_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    """A complete PNG that decodes to a picture of some size."""
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    height, width, _ = imread(path).shape  # decodes every chunk (CRCs and the compressed data)
    assert height > 200 and width > 300


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, corpus):
    """Two tiny 20-step runs, one with --ema; the curves.png bytes seen at each check of the first, which
    draws at every check as a run whose checks are seconds apart does (a tiny run's come every few ms)."""
    root, seen = tmp_path_factory.mktemp("curves"), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(curves, "DRAWING_SHARE", math.inf)
        first = train_tiny(corpus, root / "plain", lambda row: seen.append((root / "plain" / CURVES).read_bytes()),
                           max_steps=20, eval_interval=10)  # fmt: skip
    second = train_tiny(corpus, root / "averaged", max_steps=20, eval_interval=10, ema=0.9, lr=3e-3)
    return first, second, seen


def test_a_run_draws_its_curves_at_every_check_and_the_card_shows_them(two_runs):
    first, second, seen = two_runs
    assert len(seen) == 2 and seen[0].startswith(PNG_SIGNATURE) and seen[1] != seen[0]  # redrawn at each check
    assert (first / CURVES).read_bytes() == seen[1]
    for run in (first, second):  # the second drew once, at the end
        assert_png(run / CURVES)
        assert f"({CURVES})" in (run / "README.md").read_text()
    (held_out,) = [axes for axes in curves_figure(read_runs([second])).axes if "held-out nats/char" in axes.get_title()
                   and axes.get_xlabel() == "step"]  # fmt: skip
    assert [line.get_label() for line in held_out.lines] == ["averaged", "averaged (raw weights)"]


def test_plot_overlays_runs_labelled_by_folder(two_runs, tmp_path):
    first, second, _ = two_runs
    out = tmp_path / "compare.png"
    result = CliRunner().invoke(app, ["plot", str(first), str(second), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert_png(out)
    for axes in curves_figure(read_runs([first, second])).axes:
        assert [line.get_label() for line in axes.lines if "raw" not in line.get_label()] == ["plain", "averaged"]
        assert axes.get_legend() is not None


def test_plot_refuses_a_folder_without_checks_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["plot", str(tmp_path), "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert "no held-out checks yet" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_training_goes_on_and_says_how_to_get_the_picture(corpus, tmp_path, monkeypatch, capsys):
    from aftgen.training.loop import train
    from aftgen.training.options import TrainOptions

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets when it is not installed
    options = TrainOptions(corpus=corpus, out=tmp_path / "run", preset="tiny", vocab_size=400, max_steps=4,
                           eval_interval=2, device="cpu")  # fmt: skip
    run = train(options)
    assert (run / "model.safetensors").is_file() and not (run / CURVES).exists()
    assert capsys.readouterr().err.count(MISSING) == 1
