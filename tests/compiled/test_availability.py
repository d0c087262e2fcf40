"""aftgen.compiled.availability: a compiled or native path that cannot be used here falls back to what always works,
said once in one line on stderr, and shown under `aftgen bench`'s figures and in a server's /health figures."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

import aftgen.compiled.step
from aftgen import layers
from aftgen.api import load
from aftgen.bench.report import print_rows
from aftgen.compiled.functions import compile_prefill
from aftgen.compiled.step import compile_step
from aftgen.device import resolve
from aftgen.generation.scores import read_scores, token_scores
from aftgen.model import AFTLM, AFTConfig
from aftgen.native import library, scores_json, top_scores
from aftgen.serve.batch import CompiledBatchStep
from aftgen.serve.engine import Engine
from aftgen.serve.options import ServeOptions

ROW = {"measure": "step latency", "value": 1.0, "unit": "ms/token"}


def tiny_model() -> AFTLM:
    torch.manual_seed(0)
    return AFTLM(AFTConfig(vocab_size=50, n_layer=1, n_embd=32, n_head=4, window=8, context_length=64)).eval()


def bench_lines(capsys) -> list[str]:
    """What `aftgen bench` prints under a row of figures."""
    capsys.readouterr()
    print_rows([ROW], as_json=False)
    return capsys.readouterr().out.splitlines()[1:]


@pytest.fixture
def unbuildable(monkeypatch, tmp_path):
    """A machine whose C++ compiler fails every build, in a cache of this test's own, the library not yet asked for."""
    monkeypatch.setenv("AFTGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(library, "_compiler", lambda: "false")
    library.library.cache_clear()
    library.decided.cache_clear()
    yield
    library.library.cache_clear()  # the next test builds or finds the real one
    library.decided.cache_clear()


def test_a_native_library_that_will_not_build_is_said_once_and_each_use_falls_back(unbuildable, capsys):
    logits, tokens = torch.randn(3, 50), torch.tensor([1, 2, 3])
    invariance = layers.batch_invariant(None, torch.device("cpu"), True)
    assert top_scores.top_scores(logits, tokens, 5) is None and scores_json.scores_json(["a"], ["b"]) is None
    why = "NativeUnavailable: cannot build the native library: false said: no message"
    assert invariance == layers.Invariance(False, why)  # the matrix kernels' step, and why
    _, ids, _ = read_scores(token_scores(logits, tokens, 5)[0][1], 5)  # torch's scores
    assert list(ids) == logits.log_softmax(-1)[0].topk(5).indices.tolist()
    line = f"aftgen's native library cannot be used here ({why}): {library.WITHOUT}"
    assert capsys.readouterr().err.splitlines() == [f"warning: {line}"]  # once, for every use
    assert bench_lines(capsys) == [f"fallback: {line}"]


def test_a_compile_that_raises_runs_eagerly_said_once_and_shown_under_the_bench(monkeypatch, capsys):
    def no_compiler(function, **options):
        def fails(*args, **kwargs):
            raise RuntimeError("no C++ compiler found\n(the compiler's long story)")

        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    model = tiny_model()
    reader, note = compile_prefill(model, 8)
    assert reader == model.prefill and note == "eager (torch.compile failed: RuntimeError: no C++ compiler found)"
    compile_prefill(model, 8)  # the same reason again: not said again
    line = (
        "torch.compile of the prompt reader cannot be used here (RuntimeError: no C++ compiler found): it runs eagerly"
    )
    assert capsys.readouterr().err.splitlines() == [f"warning: {line}"]
    assert bench_lines(capsys) == [f"fallback: {line}"]


def test_a_step_that_cannot_be_compiled_is_said_once_and_shown_in_the_servers_figures(tiny_run, monkeypatch, capsys):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(aftgen.compiled.step, "_compiled_step", no_compiler)
    model, tokenizer = load(tiny_run, device=DEVICE)
    placement = resolve(DEVICE, "fp32")
    assert compile_step(model) == (model.step, "eager (compiling the step failed: RuntimeError: no C++ compiler found)")
    engine = Engine(model, tokenizer, ServeOptions(cache_mb=0), placement, CompiledBatchStep(model, 4, placement))
    line = "the compiled step cannot be used here (RuntimeError: no C++ compiler found): the eager step runs"
    assert capsys.readouterr().err.splitlines() == [f"warning: {line}"]
    figures = engine.stats()
    assert figures["step"] == "eager" and figures["step_note"].startswith("eager (compiling the step failed")
    assert figures["fallbacks"] == {"the compiled step": "RuntimeError: no C++ compiler found: the eager step runs"}
