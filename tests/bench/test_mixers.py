"""`aftgen bench`'s mixer comparison: probes run for every mixer, ratios and targets come out right."""

from __future__ import annotations

import pytest
from conftest import DEVICE

from aftgen.bench.mixers import comparison_targets, probe, with_ratios
from aftgen.mixers import MIXERS


@pytest.mark.parametrize("mixer", MIXERS)
def test_probe_times_a_training_step_and_the_mixer_alone(mixer):
    for kind in ("train", "mixer"):
        got = probe(kind, mixer, 256, repeats=1, threads=1, device=DEVICE)
        assert got["batch"] == 16  # 4,096 tokens per step at every length
        assert got["seconds"] > 0 and got["tokens_per_s"] == pytest.approx(4096 / got["seconds"])


def test_ratios_are_against_attention_at_the_same_length_and_targets_read_them():
    rows = [
        {"measure": "train step", "mixer": m, "length": length, "value": value}
        for m, length, value in [
            ("aft_local", 1024, 300.0),
            ("attention", 1024, 200.0),
            ("aft_local", 4096, 500.0),
            ("attention", 4096, 100.0),
        ]
    ]
    with_ratios(rows)
    assert [r["vs_attention"] for r in rows] == [1.5, 1.0, 5.0, 1.0]
    targets = {t["measure"]: t for t in comparison_targets(rows)}
    assert targets["train tokens/s aft_local / attention, T=1024"]["ok"] is True  # 1.5 >= 1.4
    assert targets["train tokens/s aft_local / attention, T=4096"]["value"] == 5.0
    assert not any("T=256" in name for name in targets)  # no row, no verdict


def test_bench_train_takes_turns_over_all_configurations_and_keeps_each_ones_fastest_round(monkeypatch):
    from aftgen.bench import mixers

    calls = []

    def fake_probe(function, kind, mixer, length, repeats, threads, device, dtype):
        calls.append((kind, mixer, length))
        round_number = calls.count((kind, mixer, length))
        # aft_local is slowed in round 1 (a busy spell), attention in round 2
        slow = (mixer == "aft_local") == (round_number == 1)
        seconds = 2.0 if slow else 1.0
        return {
            "seconds": seconds,
            "tokens_per_s": 4096 / seconds,
            "peak_mb": 10.0 * round_number,
            "batch": 4096 // length,
        }

    monkeypatch.setattr(mixers, "in_fresh_process", fake_probe)
    rows = mixers.bench_train(("aft_local", "attention"), repeats=1, rounds=2, log=lambda _: None)
    per_round = len(mixers.TRAIN_LENGTHS) * 2 * 2
    assert len(calls) == 2 * per_round and calls[:per_round] == calls[per_round:]  # whole rounds, in turn
    steps = [r for r in rows if r["measure"] == "train step"]
    assert {r["value"] for r in steps} == {4096.0}  # each mixer's undisturbed round
    assert all(r["vs_attention"] == 1.0 for r in steps)
    memory = {(r["mixer"], r["length"]): r["value"] for r in rows if r["measure"] == "train peak memory"}
    assert all(memory[m, length] == (20.0 if m == "aft_local" else 10.0) for m, length in memory)  # from that round
