"""`aftgen bench generate` (aftgen/bench/generate.py): every measure is reported and its targets judged."""

from __future__ import annotations

from conftest import on_device


def test_bench_generate_reports_every_measure_and_judges_its_targets(monkeypatch):
    # Short contexts and runs, and the eager step (as where no compiler works): the rows, not the speed.
    from aftgen.bench import generate as bench
    from aftgen.model import AFTLM, AFTConfig

    monkeypatch.setattr(bench, "STRETCH", 100)
    monkeypatch.setattr(bench, "ROUNDS", 3)
    monkeypatch.setattr(bench, "compile_step", lambda model: (model.step, "eager (test)"))
    monkeypatch.setattr(bench, "compile_prefill", lambda model, length: (model.prefill, "eager (test)"))
    model = AFTLM(AFTConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=2, window=8, context_length=32)).eval()
    rows = bench.bench_generate(
        on_device(model), log=lambda line: None, contexts=(64, 96, 128, 160), generated=(200, 600)
    )
    by_measure = {}
    for row in rows:
        by_measure.setdefault(row["measure"], []).append(row)
    assert [r["context"] for r in by_measure["step latency (eager: no compiler)"]] == [64, 96, 128, 160]
    assert [r["generated"] for r in by_measure["peak resident memory"]] == [200, 600]
    mean = by_measure["generation incl. sampling, mean"][0]["value"]
    assert 0 < by_measure["generation incl. sampling, fastest 100-token stretch"][0]["value"] <= mean
    judged = [r for r in rows if r.get("target") is not None]
    assert len(judged) == 4 and all(isinstance(r["ok"], bool) for r in judged)
    assert int(model.initial_state(1)[0]["position"]) == 0  # nothing leaked into a fresh state
