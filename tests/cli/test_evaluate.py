"""`aftgen eval` (aftgen/cli/evaluate.py): its figures are the mean negative log-likelihood, in JSON when asked."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, make_corpus, on_device
from typer.testing import CliRunner

from aftgen.api import load
from aftgen.cli import app

runner = CliRunner()


def test_eval_json(tiny_run, corpus):
    result = runner.invoke(app, ["eval", "--model", str(tiny_run), "--device", DEVICE, str(corpus), "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert set(figures) == {"nats_per_token", "nats_per_char", "bits_per_char", "bits_per_byte", "tokens", "chars"}
    assert figures["chars"] == len(corpus.read_text())
    assert 0 < figures["nats_per_char"] < figures["nats_per_token"]


def direct_nll(model, ids: list[int]) -> torch.Tensor:
    """Each token's negative log-likelihood from one plain forward pass over the whole sequence."""
    sequence = on_device(torch.tensor([ids]))
    with torch.no_grad():
        logits = model(sequence[:, :-1])[0]
    return F.cross_entropy(logits, sequence[0, 1:], reduction="none").double().cpu()


def test_eval_figures_are_the_mean_negative_log_likelihood(tiny_run, tmp_path):
    model, tokenizer = load(str(tiny_run), device=DEVICE)
    text = make_corpus(6_000, seed=9) + " caf\u00e9 \u65e5\u672c"  # past one 1,024-token chunk; multi-byte characters
    path = tmp_path / "held_out.txt"
    path.write_text(text, encoding="utf-8")
    ids = [tokenizer.bos_id, *tokenizer.encode(text)]
    assert len(ids) > 1024 + 100
    nll = direct_nll(model, ids)
    for extra, windows in (([], [nll]), (["--reset-every", "300"], [])):
        if extra:  # independent windows of 300 predicted tokens, each read from BOS + its own tokens
            windows = [direct_nll(model, ids[start : start + 301]) for start in range(0, len(nll), 300)]
        result = runner.invoke(
            app, ["eval", "--model", str(tiny_run), "--device", DEVICE, "--dtype", "fp32", str(path), "--json", *extra]
        )
        assert result.exit_code == 0, result.output
        figures, total = json.loads(result.stdout), float(torch.cat(windows).sum())
        assert figures["tokens"] == len(ids) - 1 and figures["chars"] == len(text)
        assert figures["nats_per_token"] == pytest.approx(total / (len(ids) - 1), rel=1e-5)
        assert figures["nats_per_char"] == pytest.approx(total / len(text), rel=1e-5)
        assert figures["bits_per_char"] == pytest.approx(total / len(text) / math.log(2), rel=1e-5)
        assert figures["bits_per_byte"] == pytest.approx(total / len(text.encode()) / math.log(2), rel=1e-5)
