"""Held-out scores (aftgen/evaluate.py): a file streamed in chunks scores as the whole text does, and the quick
check over many windows is their plain mean."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, on_device
from corpus_texts import corpus_text, write_text

from aftgen import evaluate
from aftgen.model import AFTLM, AFTConfig


def test_eval_streams_a_file_in_chunks(tmp_path, tiny_run, monkeypatch, one_thread):
    import aftgen
    from aftgen import evaluate
    from aftgen.corpus.sources import scan_file

    model, tokenizer = aftgen.load(tiny_run, device=DEVICE)
    text = corpus_text(8000)
    path = write_text(tmp_path / "held.txt", text)
    whole = evaluate.evaluate_text(model, tokenizer, text, reset_every=100)
    monkeypatch.setattr(evaluate, "CHUNK_CHARS", 333)  # many chunks, each cut safely
    streamed = evaluate.evaluate_file(model, tokenizer, scan_file(path), reset_every=100)
    assert streamed.tokens == whole.tokens and streamed.chars == whole.chars
    assert streamed.nats_per_char == pytest.approx(whole.nats_per_char, rel=1e-5)
    assert streamed.bits_per_byte == pytest.approx(whole.bits_per_byte, rel=1e-5)
    ids = torch.tensor([tokenizer.bos_id, *tokenizer.encode(text)])
    pieces = [ids[:5], ids[5:1500], ids[1500:]]
    assert torch.allclose(
        torch.cat(list(evaluate.score_stream(model, pieces, chunk=64))), evaluate.stream_nll(model, ids)
    )


def test_held_out_check_over_many_windows_is_the_plain_mean(tmp_path):
    torch.manual_seed(0)
    model = on_device(AFTLM(AFTConfig(vocab_size=50, n_layer=1, n_embd=16, n_head=2, window=4, context_length=16)))
    ids = torch.randint(0, 50, (2000,))
    length, windows = 16, 70  # more windows than one group of 32
    stride = (len(ids) - length - 1) // windows
    rows = on_device(torch.stack([ids[i * stride : i * stride + length + 1] for i in range(windows)]))
    with torch.no_grad():
        expected = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
    assert evaluate.window_loss(model, ids, length, windows) == pytest.approx(float(expected), rel=1e-5)
